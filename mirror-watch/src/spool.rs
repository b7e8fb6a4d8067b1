//! The seed's spool (SPEC §10, Seed): the source's revisions from before the snapshot on,
//! written to disk by `mirror-agent snapshot save` while the target is copied and restored, and
//! read by the agent for the revisions the source has compacted by the time the link runs. So
//! the seed has no deadline against the source's compaction while the spool's disk lasts.
//!
//! A file is a magic line, then records: a 4-byte length, the first 8 bytes of the SHA-256 of
//! the payload, and the payload ([`ExactRevision::encode`]). The writer appends whole records
//! and syncs; the reader takes complete records only and stops before one still being written,
//! so it can read a spool that grows. A complete record whose checksum fails is corruption.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use mirror_core::ExactRevision;
use sha2::{Digest, Sha256};

const MAGIC: &[u8] = b"etcd-mirror spool 1\n";
/// Length and checksum before each payload.
const FRAME: usize = 12;

/// A spool could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// The file could not be read or written.
    #[error("spool: {0}")]
    Io(#[from] std::io::Error),
    /// The file does not start as a spool does.
    #[error("not a spool file (no magic line)")]
    NotASpool,
    /// A complete record does not match its checksum or does not decode.
    #[error("spool record at byte {at} is corrupt")]
    Corrupt {
        /// Its offset.
        at: u64,
    },
}

fn checksum(payload: &[u8]) -> [u8; 8] {
    Sha256::digest(payload)[..8].try_into().expect("8 bytes")
}

/// Appends revisions to a new spool file.
pub struct SpoolWriter {
    file: File,
    bytes: u64,
    last: Option<i64>,
}

impl SpoolWriter {
    /// Creates `path` (which must not exist).
    pub fn create(path: &Path) -> Result<SpoolWriter, SpoolError> {
        let mut file = File::options().write(true).create_new(true).open(path)?;
        file.write_all(MAGIC)?;
        Ok(SpoolWriter { file, bytes: MAGIC.len() as u64, last: None })
    }

    /// Appends one revision (whole: a crash leaves at most a record the reader never takes).
    pub fn append(&mut self, rev: &ExactRevision) -> Result<(), SpoolError> {
        let payload = rev.encode();
        let mut record = Vec::with_capacity(FRAME + payload.len());
        record.extend((payload.len() as u32).to_be_bytes());
        record.extend(checksum(&payload));
        record.extend(&payload);
        self.file.write_all(&record)?;
        self.bytes += record.len() as u64;
        self.last = Some(rev.revision);
        Ok(())
    }

    /// Makes what was appended durable.
    pub fn sync(&mut self) -> Result<(), SpoolError> {
        Ok(self.file.sync_data()?)
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The last revision appended.
    pub fn last(&self) -> Option<i64> {
        self.last
    }
}

/// Reads a spool's complete records in order, also while it grows.
pub struct SpoolReader {
    file: File,
    at: u64,
}

impl SpoolReader {
    /// Opens `path` and checks its magic line.
    pub fn open(path: &Path) -> Result<SpoolReader, SpoolError> {
        let mut file = File::open(path)?;
        let mut magic = vec![0; MAGIC.len()];
        if file.read_exact(&mut magic).is_err() || magic != MAGIC {
            return Err(SpoolError::NotASpool);
        }
        Ok(SpoolReader { file, at: MAGIC.len() as u64 })
    }

    /// The next complete record; `None` when there is none yet (the end, or a record still
    /// being written: a later call reads it once it is whole).
    pub fn read_next(&mut self) -> Result<Option<ExactRevision>, SpoolError> {
        self.file.seek(SeekFrom::Start(self.at))?;
        let mut frame = [0u8; FRAME];
        if !read_whole(&mut self.file, &mut frame)? {
            return Ok(None);
        }
        let len = u32::from_be_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
        let mut payload = vec![0; len];
        if !read_whole(&mut self.file, &mut payload)? {
            return Ok(None);
        }
        if checksum(&payload) != frame[4..] {
            return Err(SpoolError::Corrupt { at: self.at });
        }
        let rev = ExactRevision::decode(&payload).map_err(|_| SpoolError::Corrupt { at: self.at })?;
        self.at += (FRAME + len) as u64;
        Ok(Some(rev))
    }
}

/// Fills `buf`, or says there are not that many bytes yet.
fn read_whole(file: &mut File, buf: &mut [u8]) -> Result<bool, std::io::Error> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..])? {
            0 => return Ok(false),
            n => filled += n,
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use mirror_core::Change;

    use super::*;

    fn rev(revision: i64) -> ExactRevision {
        let put = Change::Put {
            key: format!("/k/{revision}").into_bytes(),
            value: vec![7; 100],
            lease: 0,
            version: 1,
            create_revision: revision,
            prev_lease: 0,
        };
        ExactRevision { revision, changes: vec![put] }
    }

    /// The reader takes what the writer appended, in order; a record cut short (a writer
    /// mid-append) is not taken until it is whole; a flipped byte is corruption, named.
    #[test]
    fn a_growing_spool_is_read_whole_records_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seed.spool");
        let mut w = SpoolWriter::create(&path).unwrap();
        w.append(&rev(11)).unwrap();
        w.sync().unwrap();
        let mut r = SpoolReader::open(&path).unwrap();
        assert_eq!(r.read_next().unwrap(), Some(rev(11)));
        assert_eq!(r.read_next().unwrap(), None);

        // Half a record on disk, then the rest.
        let whole = {
            let payload = rev(12).encode();
            let mut b = (payload.len() as u32).to_be_bytes().to_vec();
            b.extend(checksum(&payload));
            b.extend(payload);
            b
        };
        let mut raw = File::options().append(true).open(&path).unwrap();
        raw.write_all(&whole[..20]).unwrap();
        assert_eq!(r.read_next().unwrap(), None, "a record still being written is not taken");
        raw.write_all(&whole[20..]).unwrap();
        assert_eq!(r.read_next().unwrap(), Some(rev(12)));

        // A flipped byte in a complete record.
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let mut r = SpoolReader::open(&path).unwrap();
        assert_eq!(r.read_next().unwrap(), Some(rev(11)));
        assert!(matches!(r.read_next(), Err(SpoolError::Corrupt { .. })));
        assert!(matches!(SpoolReader::open(dir.path().join("nothing").as_path()), Err(SpoolError::Io(_))));
        assert!(SpoolWriter::create(&path).is_err(), "an existing spool is never overwritten");
    }
}
