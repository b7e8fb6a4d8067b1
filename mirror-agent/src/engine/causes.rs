//! Why the engine starts genesis over, resyncs or reconnects: typed, so the run loop and the
//! buffering code match variants, and named as status, metrics and logs show them.

/// An enum of causes whose names are the reasons status, metrics and logs show.
macro_rules! causes {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident,)* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vm])* $v,)*
        }

        impl $name {
            /// The reason status, metrics and logs give: the variant of the same name.
            pub fn reason(self) -> mirror_core::Reason {
                match self {
                    $($name::$v => mirror_core::Reason::$v,)*
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.reason().as_str())
            }
        }
    };
}

causes! {
    /// Why genesis starts over from a fresh scan (not a forced resync: no prune is owed).
    Restart {
        /// The replay buffer passed `watch_buffer_bytes`.
        WatchBufferOverflow,
        /// The source compacted past the scan revision while the scan read it.
        CompactedDuringScan,
        /// The watch ended while it was buffered.
        WatchEndedDuringScan,
        /// The task buffering the watch panicked.
        ForwarderPanicked,
    }
}

causes! {
    /// Why history is gone: a forced resync with prune.
    ResyncCause {
        /// The watch could not be opened at the scan revision: compacted.
        CompactedDuringScan,
        /// The tail's watch was cancelled by a compaction past the watermark.
        WatchCompacted,
    }
}

causes! {
    /// Why both sides are connected again at once.
    ReconnectCause {
        /// A watch response was over the client's decode limit: watch in fragments from now on.
        WatchResponseTooLarge,
        /// The target refused the TLS handshake, or the files changed.
        TlsRejectedOrFilesChanged,
        /// A reload changed endpoints or credentials.
        ConnectionSettingsReloaded,
        /// The TLS files on disk changed.
        TlsFilesChanged,
    }
}
