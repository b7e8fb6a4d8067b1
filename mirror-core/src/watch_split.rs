//! Watch responses cut into pieces before they are decoded (issue #27's "decode watch
//! responses in bounded pieces", done on the client).
//!
//! etcd sends one revision's events in one watch response: a `del --prefix` of 300 000 keys
//! is a single message of about 10 MB. Decoded whole into etcd-client's types (168 bytes per
//! event plus its key) it took 60 MiB of the agent's RSS at once. etcd's own `fragment`
//! option would cut it, but the server cuts in time quadratic in a piece's events (minutes of
//! source CPU for such a revision), so the agent does not ask for it by default.
//!
//! Instead the gRPC body of every `Watch` call is read here, message by message, before tonic
//! decodes it. A message over [`PIECE_BYTES`] is re-framed, without decoding its events, into
//! messages of about [`PIECE_BYTES`] each: every piece carries the response's other fields
//! (header, watch ID, ...) and a run of its events in order, and every piece but the last is
//! flagged `fragment`, exactly as etcd flags its own fragments. Readers of a watch already join
//! fragments (`mirror_watch::Fragments`, the history reader, the exact watch), so what they see
//! is what etcd's fragments would have given them. Only one piece is built at a time: memory is
//! the encoded message plus one decoded piece, not the whole response decoded.
//!
//! A message over [`RAW_LIMIT`] passes unchanged (tonic then refuses it at its decode limit,
//! and the agent watches again asking etcd for fragments), and so does anything this reader
//! cannot parse (compressed messages, a malformed body: tonic reports those as it always did).

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::{Body, Frame};

/// The size a watch response is cut to, and the size over which it is cut.
pub const PIECE_BYTES: usize = 1 << 20;

/// Messages larger than this are passed on whole, not held here (mirror-watch's decode limit).
pub const RAW_LIMIT: usize = 12 << 20;

/// The gRPC method whose responses are cut.
pub(crate) const WATCH_PATH: &str = "/etcdserverpb.Watch/Watch";

/// `WatchResponse.fragment` (field 7, varint) and `WatchResponse.events` (field 11, bytes).
const FRAGMENT_FIELD: u64 = 7;
const EVENTS_FIELD: u64 = 11;

/// A gRPC response body whose large watch responses are re-framed into pieces.
pub struct SplitWatchBody<B> {
    inner: B,
    /// Bytes read and not yet passed on.
    buf: BytesMut,
    /// Bytes of an oversized message still to pass on unchanged.
    passing: usize,
    /// The message being cut, if any.
    cutting: Option<Pieces>,
    /// Frames to pass on once `buf` is empty (trailers), and whether the inner body ended.
    after: VecDeque<Frame<Bytes>>,
    ended: bool,
}

impl<B> SplitWatchBody<B> {
    /// Wraps a watch response body.
    pub fn new(inner: B) -> Self {
        SplitWatchBody {
            inner,
            buf: BytesMut::new(),
            passing: 0,
            cutting: None,
            after: VecDeque::new(),
            ended: false,
        }
    }

    /// The next frame that can be passed on from what was read, if any.
    fn next_out(&mut self) -> Option<Bytes> {
        if let Some(pieces) = &mut self.cutting {
            match pieces.next() {
                Some(piece) => return Some(piece),
                None => self.cutting = None,
            }
        }
        if self.passing > 0 {
            if self.buf.is_empty() {
                return None;
            }
            let n = self.passing.min(self.buf.len());
            self.passing -= n;
            return Some(self.buf.split_to(n).freeze());
        }
        if self.buf.len() < 5 {
            return None;
        }
        let compressed = self.buf[0] != 0;
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if compressed || len > RAW_LIMIT {
            self.passing = 5 + len;
            return self.next_out();
        }
        if self.buf.len() < 5 + len {
            // One allocation for the rest of the message, not a doubling per frame.
            self.buf.reserve(5 + len - self.buf.len());
            return None;
        }
        let message = self.buf.split_to(5 + len).freeze();
        if len <= PIECE_BYTES {
            return Some(message);
        }
        match Pieces::new(message.slice(5..)) {
            Some(pieces) => {
                self.cutting = Some(pieces);
                self.next_out()
            }
            None => Some(message),
        }
    }
}

impl<B> Body for SplitWatchBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        loop {
            if let Some(data) = this.next_out() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.ended || !this.after.is_empty() {
                // Whatever is left is not a whole message: pass it on for tonic to judge.
                if !this.buf.is_empty() {
                    return Poll::Ready(Some(Ok(Frame::data(this.buf.split().freeze()))));
                }
                return Poll::Ready(this.after.pop_front().map(Ok));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => this.buf.put(data),
                    Err(other) => this.after.push_back(other),
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => this.ended = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.buf.is_empty() && self.after.is_empty() && self.cutting.is_none()
    }
}

/// One large `WatchResponse` handed out as framed pieces, one at a time.
struct Pieces {
    /// The message without its gRPC header.
    message: Bytes,
    /// Every field but the events and `fragment`, encoded, for the front of each piece.
    common: Bytes,
    /// Whether the response itself was a fragment (then so is its last piece).
    fragment: bool,
    /// Where the next piece's first event starts in `message`, and where the events end.
    at: usize,
    events_end: usize,
}

impl Pieces {
    /// `None` when the message cannot be parsed, its events are not one stretch (etcd writes
    /// fields in number order, so they are), or it holds fewer than two events.
    fn new(message: Bytes) -> Option<Pieces> {
        let (mut common, mut fragment, mut events) = (BytesMut::new(), false, 0usize);
        let mut stretch: Option<(usize, usize)> = None;
        let mut at = 0;
        while at < message.len() {
            let (field, end) = field_at(&message, at)?;
            if field.is_event() {
                match &mut stretch {
                    None => stretch = Some((at, end)),
                    Some((_, stretch_end)) if *stretch_end == at => *stretch_end = end,
                    Some(_) => return None,
                }
                events += 1;
            } else if field.number == FRAGMENT_FIELD && field.wire == 0 {
                fragment = field.varint != 0;
            } else {
                common.put_slice(&message[at..end]);
            }
            at = end;
        }
        let (at, events_end) = stretch?;
        (events >= 2).then(|| Pieces { message, common: common.freeze(), fragment, at, events_end })
    }
}

impl Iterator for Pieces {
    type Item = Bytes;

    /// The next piece, framed: the common fields, events up to [`PIECE_BYTES`] (at least one),
    /// and `fragment = true` unless it is the last piece of a response that was not a fragment.
    fn next(&mut self) -> Option<Bytes> {
        let mut end = self.at;
        while end < self.events_end {
            let (_, next) = field_at(&self.message, end).expect("parsed in new");
            if end > self.at && next - self.at > PIECE_BYTES {
                break;
            }
            end = next;
        }
        if end == self.at {
            return None;
        }
        let events = &self.message[self.at..end];
        self.at = end;
        let fragment = self.at < self.events_end || self.fragment;
        let len = self.common.len() + events.len() + if fragment { 2 } else { 0 };
        let mut out = BytesMut::with_capacity(5 + len);
        out.put_u8(0);
        out.put_u32(u32::try_from(len).expect("a piece is under RAW_LIMIT"));
        out.put_slice(&self.common);
        out.put_slice(events);
        if fragment {
            // Tag of field 7, varint; value 1.
            out.put_slice(&[(FRAGMENT_FIELD << 3) as u8, 1]);
        }
        Some(out.freeze())
    }
}

/// One protobuf field's tag (and its value, for a varint).
struct Field {
    number: u64,
    wire: u8,
    varint: u64,
}

impl Field {
    fn is_event(&self) -> bool {
        self.number == EVENTS_FIELD && self.wire == 2
    }
}

/// The field starting at `at` and where the next one starts; `None` if it is malformed.
fn field_at(message: &[u8], at: usize) -> Option<(Field, usize)> {
    let mut rest = message.get(at..)?;
    let before = rest.len();
    let tag = varint(&mut rest)?;
    let (number, wire) = (tag >> 3, (tag & 7) as u8);
    let mut value = 0;
    match wire {
        0 => value = varint(&mut rest)?,
        1 => skip(&mut rest, 8)?,
        2 => {
            let len = usize::try_from(varint(&mut rest)?).ok()?;
            skip(&mut rest, len)?;
        }
        5 => skip(&mut rest, 4)?,
        _ => return None,
    }
    Some((Field { number, wire, varint: value }, at + before - rest.len()))
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf.first()?;
        buf.advance(1);
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

fn skip(buf: &mut &[u8], n: usize) -> Option<()> {
    (buf.len() >= n).then(|| buf.advance(n))
}

/// A channel whose `Watch` responses are read through [`SplitWatchBody`]; every other call
/// passes untouched.
#[derive(Clone)]
pub(crate) struct SplitWatch(pub(crate) tonic::transport::Channel);

type Request = http::Request<tonic::body::Body>;
type Response = http::Response<tonic::body::Body>;

impl tower::Service<Request> for SplitWatch {
    type Response = Response;
    type Error = tower::BoxError;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<Response, tower::BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), tower::BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let split = request.uri().path() == WATCH_PATH;
        let response = self.0.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(if split {
                response.map(|body| tonic::body::Body::new(SplitWatchBody::new(body)))
            } else {
                response
            })
        })
    }
}

#[cfg(test)]
#[path = "watch_split_tests.rs"]
mod tests;
