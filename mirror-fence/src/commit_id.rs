//! Commit ids: every checkpoint record carries one, unique to the attempt that wrote it and
//! starting with its writer's nonce, so a re-read tells "my lost answer landed" from "another
//! writer of my epoch".

/// A random nonce for one writer (a claim and the commits of the writer it makes): every
/// commit id it sends starts with it, so a stored record tells whether this writer wrote it.
pub(crate) fn writer_nonce() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    // Each RandomState has fresh keys (seeded from the OS's randomness, then stepped).
    format!("{:016x}", std::collections::hash_map::RandomState::new().build_hasher().finish())
}

/// A commit id unique to this attempt: the writer's nonce and a counter.
pub(crate) fn next_commit_id(nonce: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!("{nonce}-{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Whether `commit` is an id made with `nonce`.
pub(crate) fn made_with(commit: &str, nonce: &str) -> bool {
    commit.strip_prefix(nonce).is_some_and(|rest| rest.starts_with('-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Commit ids never repeat and carry their writer's nonce; two writers (two pods with the
    /// same host name and pid, or two in one process) never share a nonce, so a writer never
    /// takes another's record for its own.
    #[test]
    fn commit_ids_are_unique_and_name_their_writer() {
        let (a, b) = (writer_nonce(), writer_nonce());
        assert_ne!(a, b);
        let ids: std::collections::HashSet<String> = (0..10_000).map(|_| next_commit_id(&a)).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|id| made_with(id, &a) && !made_with(id, &b)));
        assert!(!made_with(&format!("{a}0-1"), &a), "a longer nonce is another writer's");
    }
}
