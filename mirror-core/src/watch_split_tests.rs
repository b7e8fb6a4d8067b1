use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use etcd_client::proto::{PbEvent, PbKeyValue, PbResponseHeader, PbWatchResponse};
use http::HeaderMap;
use http_body::{Body, Frame};
use prost::Message;

use super::{SplitWatchBody, PIECE_BYTES, RAW_LIMIT};

/// A body that hands out fixed frames.
struct Frames(VecDeque<Frame<Bytes>>);

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

fn framed(compressed: bool, body: &[u8]) -> Bytes {
    let mut out = BytesMut::new();
    out.put_u8(u8::from(compressed));
    out.put_u32(body.len() as u32);
    out.put_slice(body);
    out.freeze()
}

fn response(events: usize, value_size: usize, fragment: bool) -> PbWatchResponse {
    let event = |i: usize| PbEvent {
        r#type: (i % 2) as i32,
        kv: Some(PbKeyValue {
            key: format!("/k/{i:08}").into_bytes(),
            value: vec![b'v'; value_size],
            mod_revision: 42,
            ..Default::default()
        }),
        prev_kv: None,
    };
    PbWatchResponse {
        header: Some(PbResponseHeader { revision: 77, cluster_id: 9, ..Default::default() }),
        watch_id: 3,
        fragment,
        events: (0..events).map(event).collect(),
        ..Default::default()
    }
}

/// Everything `stream` gives, cut into frames of `chunk` bytes, read through the splitter:
/// the data as one byte string, and the non-data frames.
fn read_through(stream: &[u8], chunk: usize, trailers: bool) -> (Bytes, usize) {
    let mut frames: VecDeque<Frame<Bytes>> =
        stream.chunks(chunk).map(|c| Frame::data(Bytes::copy_from_slice(c))).collect();
    if trailers {
        frames.push_back(Frame::trailers(HeaderMap::new()));
    }
    let mut body = SplitWatchBody::new(Frames(frames));
    let (mut data, mut other) = (BytesMut::new(), 0);
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    loop {
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => data.put(d),
                Err(_) => {
                    assert_eq!(other, 0, "one trailers frame, after every data frame");
                    other += 1;
                }
            },
            Poll::Ready(None) => break,
            Poll::Ready(Some(Err(e))) => match e {},
            Poll::Pending => unreachable!("the test body is always ready"),
        }
    }
    assert!(body.is_end_stream());
    (data.freeze(), other)
}

/// The gRPC messages of a stream, as (compressed, body).
fn messages(mut stream: &[u8]) -> Vec<(bool, Vec<u8>)> {
    let mut out = Vec::new();
    while !stream.is_empty() {
        let len = u32::from_be_bytes(stream[1..5].try_into().unwrap()) as usize;
        out.push((stream[0] != 0, stream[5..5 + len].to_vec()));
        stream = &stream[5 + len..];
    }
    out
}

/// A 3 MB response between two small ones, read in 7 KiB frames: the small ones pass byte for
/// byte; the large one comes as pieces of at most PIECE_BYTES (plus the common fields), each
/// with the header and watch ID, all flagged `fragment` but the last, whose events in order
/// are the response's; the trailers come last.
#[test]
fn a_large_response_comes_as_fragments_holding_its_events_in_order() {
    let small = response(3, 10, false).encode_to_vec();
    let large = response(3000, 1000, false);
    let mut stream = BytesMut::new();
    stream.put(framed(false, &small));
    stream.put(framed(false, &large.encode_to_vec()));
    stream.put(framed(false, &small));
    let (out, trailers) = read_through(&stream, 7 << 10, true);
    assert_eq!(trailers, 1);
    let got = messages(&out);
    assert_eq!(got.first().map(|m| &m.1), Some(&small));
    assert_eq!(got.last().map(|m| &m.1), Some(&small));
    let pieces: Vec<PbWatchResponse> =
        got[1..got.len() - 1].iter().map(|(_, b)| PbWatchResponse::decode(b.as_slice()).unwrap()).collect();
    assert!(pieces.len() >= 3, "3 MB in pieces of 1 MiB: {} pieces", pieces.len());
    for (i, piece) in pieces.iter().enumerate() {
        assert_eq!(piece.fragment, i + 1 < pieces.len(), "piece {i}");
        assert_eq!(piece.header, large.header);
        assert_eq!(piece.watch_id, 3);
        assert!(piece.encoded_len() <= PIECE_BYTES + 64, "piece {i}: {} bytes", piece.encoded_len());
    }
    let events: Vec<PbEvent> = pieces.into_iter().flat_map(|p| p.events).collect();
    assert_eq!(events, large.events);
}

/// A response that etcd itself flagged `fragment` stays one: so is its last piece.
#[test]
fn a_fragment_cut_again_is_fragments_to_its_last_piece() {
    let large = response(2000, 1000, true);
    let (out, _) = read_through(&framed(false, &large.encode_to_vec()), 64 << 10, false);
    let pieces: Vec<PbWatchResponse> =
        messages(&out).iter().map(|(_, b)| PbWatchResponse::decode(b.as_slice()).unwrap()).collect();
    assert!(pieces.len() >= 2);
    assert!(pieces.iter().all(|p| p.fragment));
    assert_eq!(pieces.into_iter().flat_map(|p| p.events).collect::<Vec<_>>(), large.events);
}

/// One event larger than a piece still goes alone, whole.
#[test]
fn an_event_larger_than_a_piece_is_a_piece_of_its_own() {
    let mut large = response(3, 10, false);
    large.events[1].kv.as_mut().unwrap().value = vec![b'x'; PIECE_BYTES + 10];
    let (out, _) = read_through(&framed(false, &large.encode_to_vec()), 1 << 20, false);
    let pieces: Vec<PbWatchResponse> =
        messages(&out).iter().map(|(_, b)| PbWatchResponse::decode(b.as_slice()).unwrap()).collect();
    assert_eq!(pieces.len(), 3);
    assert_eq!(pieces.into_iter().flat_map(|p| p.events).collect::<Vec<_>>(), large.events);
}

/// What the splitter must not touch passes byte for byte: a compressed message, one over
/// RAW_LIMIT (tonic refuses it at its decode limit, as before), one it cannot parse, and bytes
/// that end mid-message.
#[test]
fn what_cannot_be_cut_passes_unchanged() {
    let over = response(14, 1 << 20, false).encode_to_vec();
    assert!(over.len() > RAW_LIMIT);
    let garbage = vec![0xff; PIECE_BYTES + 100];
    let large = response(3000, 1000, false).encode_to_vec();
    for stream in [framed(true, &large), framed(false, &over), framed(false, &garbage)] {
        let (out, _) = read_through(&stream, 5 << 10, false);
        assert!(out == stream, "changed a message of {} bytes", stream.len());
    }
    let cut_short = framed(false, &response(3, 10, false).encode_to_vec()).slice(..20);
    assert_eq!(read_through(&cut_short, 3, true), (cut_short, 1));
}
