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
    /// What this job loads (a fingerprint of what tells it from another job: the checkpoint,
    /// the layout; 0 when unknown): rank 0 refuses a connection that checks in with another one,
    /// a rank of a different job on the same port, on that connection alone (the job goes on
    /// waiting for its own ranks).
    pub job: u64,
    /// The options of the job's plan that every rank must plan with, each under the name a user
    /// knows it by (`("--read-order", "storage")`); empty when the front end has none to
    /// compare. Unlike [`job`](Self::job), which tells this job from another on the same port,
    /// a difference here is within the job (one of its own ranks started with another flag):
    /// rank 0 compares every rank's with its own once all are in and, on any difference, calls
    /// the whole job off at once ([`LoaderError::RanksDisagree`] on every rank), rather than
    /// letting the ranks execute plans that do not fit together and fail late, each blaming a
    /// peer.
    pub plan: Vec<(String, String)>,
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
            plan: Vec::new(),
        };
        config.check()?;
        Ok(config)
    }

    /// The same configuration for the job with fingerprint `job` (see [`RendezvousConfig::job`]).
    pub fn with_job(self, job: u64) -> Self {
        Self { job, ..self }
    }

    /// The same configuration with the plan options every rank must share (see
    /// [`RendezvousConfig::plan`]).
    pub fn with_plan(self, plan: Vec<(String, String)>) -> Self {
        Self { plan, ..self }
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

/// How rank `rank`'s plan options (`theirs`) differ from rank 0's (`ours`), one phrase per
/// option, in rank 0's order: `rank 1 plans with --read-order storage but rank 0 with
/// --read-order auto`. An option only one side names (a front end of another version) differs
/// too.
pub fn plan_differences(
    rank: u32,
    theirs: &[(String, String)],
    ours: &[(String, String)],
) -> Vec<String> {
    let value = |terms: &[(String, String)], name: &str| {
        terms
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let mut names: Vec<&str> = ours.iter().map(|(n, _)| n.as_str()).collect();
    for (name, _) in theirs {
        if !names.contains(&name.as_str()) {
            names.push(name);
        }
    }
    let with = |value: &Option<String>, name: &str| match value {
        Some(value) => format!("with {name} {value}"),
        None => format!("without {name}"),
    };
    names
        .into_iter()
        .filter_map(|name| {
            let (their, our) = (value(theirs, name), value(ours, name));
            (their != our).then(|| {
                format!(
                    "rank {rank} plans {} but rank 0 {}",
                    with(&their, name),
                    with(&our, name)
                )
            })
        })
        .collect()
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

    #[test]
    fn plan_differences_name_the_option_both_values_and_the_rank() {
        let terms = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(n, v)| ((*n).to_string(), (*v).to_string()))
                .collect()
        };
        let ours = terms(&[("--read-order", "auto"), ("dedup", "on")]);
        assert!(plan_differences(1, &ours, &ours).is_empty());
        assert_eq!(
            plan_differences(
                2,
                &terms(&[("dedup", "off"), ("--read-order", "storage"), ("new", "x")]),
                &ours
            ),
            [
                "rank 2 plans with --read-order storage but rank 0 with --read-order auto",
                "rank 2 plans with dedup off but rank 0 with dedup on",
                "rank 2 plans with new x but rank 0 without new",
            ]
        );
        assert_eq!(
            plan_differences(1, &terms(&[("dedup", "on")]), &ours),
            ["rank 1 plans without --read-order but rank 0 with --read-order auto"]
        );
    }
}
