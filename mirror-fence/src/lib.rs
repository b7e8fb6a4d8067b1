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
//! ## What it deliberately does not do (yet)
//! The fenced Txn writer and the standby rules arrive with the engine.

mod checkpoint;

pub use checkpoint::{Checkpoint, DecodeError, Role, VERSION};
