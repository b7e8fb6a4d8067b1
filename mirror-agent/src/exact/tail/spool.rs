//! The seed's spool replayed by the tail: after the source compacted what the watch would have
//! brought, its revisions come from the spool, read as they land (G6), and the watch is opened
//! again after its end.

use tracing::info;

use super::super::flight::Flight;
use super::{SpoolReplay, Stop, Tail};

impl Tail<'_> {
    /// Starts replaying the seed's spool after the last revision received
    /// ([`SpoolReplay`]) and queues its first revision; false when no spool holds it.
    pub(super) fn replay_spool(&mut self, flight: &mut Flight) -> Result<bool, Stop> {
        let Some(mut replay) = SpoolReplay::open(self.cfg, self.received)? else { return Ok(false) };
        let Some(first) = replay.next()? else { return Ok(false) };
        self.received = first.revision;
        flight.receive(first);
        self.replay = Some(replay);
        Ok(true)
    }

    /// Queues the spool's next revisions while what waits to land is under the bound; at the
    /// spool's end the replay is over (the watch is opened again after it).
    pub(super) fn read_spool(&mut self, flight: &mut Flight) -> Result<(), Stop> {
        while let Some(replay) = self.replay.as_mut() {
            if flight.holds(self.hold) {
                break;
            }
            match replay.next()? {
                Some(rev) => {
                    self.received = rev.revision;
                    flight.receive(rev);
                }
                None => {
                    let (read, to) = (replay.read, replay.last());
                    info!(read, to, "replayed the seed's spool, which holds revisions the source compacted");
                    self.replay = None;
                }
            }
        }
        Ok(())
    }
}
