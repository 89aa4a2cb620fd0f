//! How the ranks of a job find each other: this rank, the world size, and the master (rank 0)
//! address every rank reaches first. Front ends build it (from flags and torchrun's variables,
//! by the one rule of `tessera_ops::load::rendezvous`); nothing here reads the environment.

use std::fmt;

use crate::LoaderError;

/// Where and as whom to rendezvous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// This rank, `0..world`.
    pub rank: u32,
    /// Number of ranks.
    pub world: u32,
    /// Host of rank 0 (name or IP); rank 0 listens there.
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous.
    pub master_port: u16,
    /// What this job loads (a fingerprint of the plan's inputs, 0 when unknown): rank 0 refuses a
    /// rank that checks in with another one, which is a rank of a different job or a different
    /// checkpoint, layout or option on the same port.
    pub job: u64,
}

impl RendezvousConfig {
    /// An explicit configuration, checked (`rank < world`, a master address).
    pub fn new(
        rank: u32,
        world: u32,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Result<Self, LoaderError> {
        let config = Self {
            rank,
            world,
            master_addr: master_addr.into(),
            master_port,
            job: 0,
        };
        config.check()?;
        Ok(config)
    }

    /// The same configuration for the job with fingerprint `job` (see [`RendezvousConfig::job`]).
    pub fn with_job(self, job: u64) -> Self {
        Self { job, ..self }
    }

    fn check(&self) -> Result<(), LoaderError> {
        if self.world == 0 {
            return Err(LoaderError::Rendezvous {
                detail: "the world size (WORLD_SIZE) must be at least 1".to_string(),
            });
        }
        if self.rank >= self.world {
            return Err(LoaderError::Rendezvous {
                detail: format!(
                    "rank (RANK) {} is outside the world of {} ranks (WORLD_SIZE)",
                    self.rank, self.world
                ),
            });
        }
        if self.master_addr.trim().is_empty() {
            return Err(LoaderError::Rendezvous {
                detail: "the master address (MASTER_ADDR) is empty".to_string(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for RendezvousConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} via {}:{}",
            self.rank, self.world, self.master_addr, self.master_port
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_outside_the_world_or_no_address_is_refused() {
        let err = RendezvousConfig::new(8, 8, "h", 1).unwrap_err().to_string();
        assert!(err.contains("outside the world"), "{err}");
        assert!(RendezvousConfig::new(0, 0, "localhost", 1).is_err());
        let err = RendezvousConfig::new(0, 1, " ", 1).unwrap_err().to_string();
        assert!(err.contains("master address"), "{err}");
        assert_eq!(
            RendezvousConfig::new(3, 8, "127.0.0.1", 29500)
                .unwrap()
                .to_string(),
            "rank 3 of 8 via 127.0.0.1:29500"
        );
    }
}
