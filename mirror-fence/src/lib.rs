//! # mirror-fence
//!
//! The fence of SPEC §6: the checkpoint record stored in the target at a reserved key, which
//! both says how far the target reflects the source (the watermark) and who may write (link,
//! epoch, role).
//!
//! ## What it guarantees
//! - [`Checkpoint::decode`] fails closed (G7): any missing, mistyped, out-of-range or unknown
//!   field is an error naming the field, so an agent never writes under a record it does not
//!   fully understand.
//! - `decode(encode(c)) == c` for every valid record (property-tested).
//!
//! - [`FencedWriter`] is the only way the agent writes to the target (G4): every Txn compares the
//!   checkpoint's mod revision (or, sent behind another, its value: the record the one before
//!   stores), every checkpoint move rides in the same Txn as its data, and a
//!   failed compare is judged by re-reading the record (see the `writer` module for the
//!   argument, the ambiguous-commit rule and the takeover rules).
//! - A Txn with more ops than the target's `max_txn_ops` is laid out with nested Txns
//!   ([`nest`]), so any revision whose bytes fit the target's request limit lands atomically,
//!   with its checkpoint, in one target revision (G2).
//!
//! - [`Applier`] owns a compact-mode run's writer and lands its writes: retries by error class
//!   with the throttle curve carried over, the pace of `max_ops_per_second`, nesting deeper and
//!   splitting independent ops the target finds too large, and the tail's Txns in flight
//!   (`sync.txns_in_flight`: [`Applier::send`], each one behind another fenced by the record the
//!   one before stores, answers taken in order, any write else waiting for them). It reports
//!   through [`Owner`] and keeps no status of its own.
//!
//! - [`FenceObserver`] sequences reads of the checkpoint so a stale answer never takes the
//!   view backwards, and shares the first read among concurrent callers.
//!
//! - [`ExactFence`] builds exact mode's Txn of one source revision (SPEC §10): compares that
//!   only its predecessor's landing satisfies and the source's view of every key it touches, so
//!   source revision R lands as target revision R or not at all, and judges each answer (landed,
//!   reordered, another replica ahead, a foreign write).
//!

//! ## What it deliberately does not do
//! It does not decide what to do about a lost fence (standby, fail): it names the outcome with
//! [`FenceError`] and the agent acts on it. It never retries a failed compare blindly.

mod applier;
mod checkpoint;
mod commit_id;
pub mod election;
mod error;
mod exact;
mod nest;
mod observed;
mod observer;
mod transitions;
mod writer;

pub use applier::{on_write_error, Answered, Applier, OnWriteError, Owner, Stop, WriteTrouble};
pub use checkpoint::{Checkpoint, DecodeError, Role, VERSION};
pub use error::FenceError;
pub use exact::{Answer, ExactFence, Guard, Landing, RevisionTxn, Stamp};
pub use nest::{nest, nested_txn_capacity, ops_per_level, plan, Slot, TooManyOps, NESTED_TXNS};
pub use observed::{may_claim, read_checkpoint, read_checkpoint_since, Observed};
pub use observer::FenceObserver;
pub use writer::{DataWriter, FencedWriter};
