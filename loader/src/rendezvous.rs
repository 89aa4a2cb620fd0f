//! How the ranks of a job find each other: this rank, the world size, and the master (rank 0)
//! address every rank reaches first. Read from torchrun's environment (`RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`) or given explicitly (command-line flags).

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

    /// Reads torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`.
    pub fn from_env() -> Result<Self, LoaderError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`RendezvousConfig::from_env`], with the variables looked up through `var`.
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self, LoaderError> {
        let get = |name: &str| -> Result<String, LoaderError> {
            match var(name) {
                Some(value) if !value.trim().is_empty() => Ok(value.trim().to_string()),
                Some(_) => Err(LoaderError::Rendezvous {
                    detail: format!("environment variable {name} is empty"),
                }),
                None => Err(LoaderError::Rendezvous {
                    detail: format!(
                        "environment variable {name} is not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                    ),
                }),
            }
        };
        fn number<N: std::str::FromStr>(
            name: &str,
            value: &str,
            what: &str,
        ) -> Result<N, LoaderError> {
            value.parse().map_err(|_| LoaderError::Rendezvous {
                detail: format!("environment variable {name}={value:?} is not {what}"),
            })
        }
        let rank_text = get("RANK")?;
        let world_text = get("WORLD_SIZE")?;
        let master_addr = get("MASTER_ADDR")?;
        let port_text = get("MASTER_PORT")?;
        let config = Self {
            rank: number("RANK", &rank_text, "a rank (a non-negative integer)")?,
            world: number(
                "WORLD_SIZE",
                &world_text,
                "a world size (a positive integer)",
            )?,
            master_addr,
            master_port: number("MASTER_PORT", &port_text, "a TCP port (0 to 65535)")?,
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
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    const TORCHRUN: [(&str, &str); 4] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn torchrun_variables() {
        let config = RendezvousConfig::from_lookup(lookup(&TORCHRUN)).unwrap();
        assert_eq!(
            config,
            RendezvousConfig::new(3, 8, "127.0.0.1", 29500).unwrap()
        );
    }

    #[test]
    fn each_missing_variable_is_named() {
        for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let vars: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != missing)
                .collect();
            let err = RendezvousConfig::from_lookup(lookup(&vars))
                .unwrap_err()
                .to_string();
            assert!(err.contains(missing) && err.contains("not set"), "{err}");
        }
    }

    #[test]
    fn invalid_values_are_named() {
        for (name, value) in [
            ("RANK", "-1"),
            ("WORLD_SIZE", "eight"),
            ("MASTER_PORT", "70000"),
            ("MASTER_ADDR", " "),
        ] {
            let mut vars: Vec<_> = TORCHRUN
                .iter()
                .copied()
                .filter(|(k, _)| *k != name)
                .collect();
            vars.push((name, value));
            let err = RendezvousConfig::from_lookup(lookup(&vars))
                .unwrap_err()
                .to_string();
            assert!(err.contains(name), "{name}={value}: {err}");
        }
    }

    #[test]
    fn rank_outside_world() {
        let mut vars: Vec<_> = TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != "RANK")
            .collect();
        vars.push(("RANK", "8"));
        let err = RendezvousConfig::from_lookup(lookup(&vars))
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside the world"), "{err}");
        assert!(RendezvousConfig::new(0, 0, "localhost", 1).is_err());
    }
}
