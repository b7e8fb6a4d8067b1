//! The revision of an etcd snapshot file, read from its bbolt pages: what `etcdutl snapshot
//! status` prints as `revision` (the main revision of the last key of the `key` bucket, whose
//! keys are 8-byte big-endian main revisions, `_`, the sub-revision). The Snapshot stream
//! carries no revision (SPEC §10), so `snapshot save` reads it from the file it wrote.
//!
//! bbolt's layout (etcd-io/bbolt `internal/common/page.go`, `meta.go`), little-endian: every
//! page starts with a 16-byte header (id u64, flags u16, count u16, overflow u32). Pages 0 and 1
//! are meta pages (magic 0xED0CDAED, version, page size, flags, the root bucket's root page and
//! sequence, freelist, high-water page, txid, checksum); the one with the higher txid holds.
//! A branch page (flag 0x01) holds `count` elements (pos u32, ksize u32, child page u64), a
//! leaf page (0x02) `count` elements (flags u32, pos u32, ksize u32, vsize u32), each key at the
//! element's own offset + pos. A leaf element with flag 0x01 is a bucket: its value is the
//! bucket's root page and sequence, followed, when the root page is 0, by the bucket's own page
//! inline.

const MAGIC: u32 = 0xED0C_DAED;
const HEADER: usize = 16;
const ELEMENT: usize = 16;
const BRANCH: u16 = 0x01;
const LEAF: u16 = 0x02;
const BUCKET: u32 = 0x01;

/// The file is not a bbolt file etcd wrote, or is cut short.
#[derive(Debug, thiserror::Error)]
#[error("not an etcd snapshot: {0}")]
pub struct NotASnapshot(String);

fn bad(what: impl Into<String>) -> NotASnapshot {
    NotASnapshot(what.into())
}

/// The snapshot's revision (`None`: no key was ever written).
pub fn revision(file: &[u8]) -> Result<Option<i64>, NotASnapshot> {
    let page_size = [0, 1]
        .into_iter()
        .filter_map(|i| Meta::read(file, i * 4096).ok())
        .next()
        .ok_or_else(|| bad("no meta page"))?
        .page_size;
    let metas: Vec<Meta> = [0, page_size].into_iter().filter_map(|at| Meta::read(file, at).ok()).collect();
    let meta = metas.into_iter().max_by_key(|m| m.txid).ok_or_else(|| bad("no valid meta page"))?;
    let db = Db { file, page_size: meta.page_size };
    let root = db.page(meta.root)?;
    let Some(bucket) = db.find(root, b"key")? else { return Err(bad("no `key` bucket")) };
    let Some(last) = db.last_key(bucket)? else { return Ok(None) };
    let main: [u8; 8] =
        last.get(..8).and_then(|b| b.try_into().ok()).ok_or_else(|| bad("a short revision key"))?;
    Ok(Some(i64::from_be_bytes(main)))
}

struct Meta {
    page_size: usize,
    root: u64,
    txid: u64,
}

impl Meta {
    fn read(file: &[u8], at: usize) -> Result<Meta, NotASnapshot> {
        let m = file.get(at + HEADER..at + HEADER + 64).ok_or_else(|| bad("cut short"))?;
        if u32_at(m, 0) != MAGIC {
            return Err(bad("bad magic"));
        }
        // magic, version, page size, flags, root (pgid, sequence), freelist, pgid, txid, checksum.
        let checksum = u64_at(m, 56);
        if fnv64a(&m[..56]) != checksum {
            return Err(bad("meta checksum"));
        }
        Ok(Meta { page_size: u32_at(m, 8) as usize, root: u64_at(m, 16), txid: u64_at(m, 48) })
    }
}

/// A page: its bytes from the header on (for an inline bucket, the bytes after the bucket
/// header).
#[derive(Clone, Copy)]
struct Page<'a>(&'a [u8]);

impl<'a> Page<'a> {
    fn flags(self) -> u16 {
        u16::from_le_bytes([self.0[8], self.0[9]])
    }

    fn count(self) -> usize {
        u16::from_le_bytes([self.0[10], self.0[11]]) as usize
    }

    /// Element `i`'s offset and its key.
    fn key(self, i: usize) -> Result<(usize, &'a [u8]), NotASnapshot> {
        let at = HEADER + i * ELEMENT;
        let (pos_at, ksize_at) = if self.flags() == LEAF { (at + 4, at + 8) } else { (at, at + 4) };
        let (pos, ksize) = (u32_at(self.0, pos_at) as usize, u32_at(self.0, ksize_at) as usize);
        let key = self.0.get(at + pos..at + pos + ksize).ok_or_else(|| bad("a key past its page"))?;
        Ok((at, key))
    }
}

struct Db<'a> {
    file: &'a [u8],
    page_size: usize,
}

impl<'a> Db<'a> {
    fn page(&self, id: u64) -> Result<Page<'a>, NotASnapshot> {
        let at = id as usize * self.page_size;
        let header = self.file.get(at..at + HEADER).ok_or_else(|| bad("a page past the end"))?;
        let overflow = u32_at(header, 12) as usize;
        let end = (at + (overflow + 1) * self.page_size).min(self.file.len());
        Ok(Page(&self.file[at..end]))
    }

    /// The bucket `name` of the bucket whose root is `page`.
    fn find(&self, page: Page<'a>, name: &[u8]) -> Result<Option<Page<'a>>, NotASnapshot> {
        match page.flags() {
            BRANCH => {
                let mut child = None;
                for i in 0..page.count() {
                    let (at, key) = page.key(i)?;
                    if key > name && child.is_some() {
                        break;
                    }
                    child = Some(u64_at(page.0, at + 8));
                }
                match child {
                    Some(id) => self.find(self.page(id)?, name),
                    None => Ok(None),
                }
            }
            LEAF => {
                for i in 0..page.count() {
                    let (at, key) = page.key(i)?;
                    if key == name && u32_at(page.0, at) & BUCKET != 0 {
                        let (pos, ksize, vsize) = (
                            u32_at(page.0, at + 4) as usize,
                            u32_at(page.0, at + 8) as usize,
                            u32_at(page.0, at + 12) as usize,
                        );
                        let value = page
                            .0
                            .get(at + pos + ksize..at + pos + ksize + vsize)
                            .ok_or_else(|| bad("value"))?;
                        let root = u64_at(value, 0);
                        return Ok(Some(if root == 0 { Page(&value[16..]) } else { self.page(root)? }));
                    }
                }
                Ok(None)
            }
            other => Err(bad(format!("page flags {other:#x} where a bucket tree was expected"))),
        }
    }

    /// The last key of the tree whose root is `page`.
    fn last_key(&self, page: Page<'a>) -> Result<Option<&'a [u8]>, NotASnapshot> {
        if page.count() == 0 {
            return Ok(None);
        }
        let (at, key) = page.key(page.count() - 1)?;
        match page.flags() {
            BRANCH => self.last_key(self.page(u64_at(page.0, at + 8))?),
            LEAF => Ok(Some(key)),
            other => Err(bad(format!("page flags {other:#x} in a bucket tree"))),
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).map_or(0, |s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

/// FNV-1a, 64 bits: bbolt's meta checksum.
fn fnv64a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that is not a snapshot is named as such, never read as revision 0.
    #[test]
    fn garbage_is_not_a_snapshot() {
        assert!(revision(&[0u8; 100]).is_err());
        assert!(revision(&vec![7u8; 3 * 4096]).is_err());
    }

    /// bbolt's checksum is FNV-1a 64 (its published test vectors).
    #[test]
    fn the_meta_checksum_is_fnv1a() {
        assert_eq!(fnv64a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv64a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
