//! In-process transport: the ranks of a mesh share one set of mailboxes, so a message is handed
//! over without a copy (`Bytes` is reference-counted). Used by tests and by single-process runs
//! that play several ranks on threads or tasks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;

use super::{Mailbox, Transport, TransportOptions, check_peer};
use crate::LoaderError;

struct Shared {
    mailboxes: Vec<Mailbox>,
    alive: Vec<AtomicBool>,
}

/// One rank's end of an in-process mesh. Dropping it counts as the rank dying: the others' `recv`
/// from it fail at once (after what it sent is consumed), and sends to it fail.
pub struct InProcTransport {
    rank: u32,
    world: u32,
    options: TransportOptions,
    shared: Arc<Shared>,
}

impl InProcTransport {
    /// A fully connected mesh of `world` ranks; element `i` is rank `i`.
    pub fn mesh(world: u32, options: TransportOptions) -> Vec<InProcTransport> {
        let shared = Arc::new(Shared {
            mailboxes: (0..world).map(|r| Mailbox::new(r, world)).collect(),
            alive: (0..world).map(|_| AtomicBool::new(true)).collect(),
        });
        (0..world)
            .map(|rank| InProcTransport {
                rank,
                world,
                options: options.clone(),
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    fn send_now(&self, to: u32, tag: u64, data: Bytes) -> Result<(), LoaderError> {
        check_peer(self.rank, self.world, to, "send to")?;
        let (Some(alive), Some(mailbox)) = (
            self.shared.alive.get(to as usize),
            self.shared.mailboxes.get(to as usize),
        ) else {
            return Err(LoaderError::Transport {
                rank: self.rank,
                peer: to,
                detail: "no such rank in the mesh".to_string(),
            });
        };
        if !alive.load(Ordering::Acquire) {
            return Err(LoaderError::Transport {
                rank: self.rank,
                peer: to,
                detail: format!("sending tag {tag:#x}: rank {to} has exited"),
            });
        }
        mailbox.deliver(self.rank, tag, data);
        Ok(())
    }
}

impl Transport for InProcTransport {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    async fn send(&self, to: u32, tag: u64, data: Bytes) -> Result<(), LoaderError> {
        self.send_now(to, tag, data)
    }

    async fn recv(&self, from: u32, tag: u64) -> Result<Bytes, LoaderError> {
        let Some(mailbox) = self.shared.mailboxes.get(self.rank as usize) else {
            return Err(LoaderError::Transport {
                rank: self.rank,
                peer: from,
                detail: "this rank has no mailbox".to_string(),
            });
        };
        mailbox.recv(from, tag, self.options.timeout).await
    }

    fn direct_copies(&self) -> bool {
        true
    }
}

impl Drop for InProcTransport {
    fn drop(&mut self) {
        if let Some(alive) = self.shared.alive.get(self.rank as usize) {
            alive.store(false, Ordering::Release);
        }
        if let Some(own) = self.shared.mailboxes.get(self.rank as usize) {
            own.clear();
        }
        let reason = format!(
            "rank {} exited (its in-process transport was dropped)",
            self.rank
        );
        for (peer, mailbox) in self.shared.mailboxes.iter().enumerate() {
            if peer as u32 != self.rank {
                mailbox.peer_gone(self.rank, reason.clone());
            }
        }
    }
}

impl std::fmt::Debug for InProcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}
