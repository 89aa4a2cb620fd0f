//! What the ranks of one load must agree on before any of them reads, beside the world size:
//! that they load the same checkpoint (part of the job's fingerprint,
//! [`RendezvousConfig::job`]: a rank that differs is another job's), and that they plan it
//! with the same options ([`plan_terms`], [`RendezvousConfig::plan`]: a rank that differs is
//! this job's, started with another flag, and the job is called off at once on every rank,
//! naming the option). Rank 0 checks both at the rendezvous.
//!
//! The same checkpoint is often named differently by different ranks: a relative path from
//! another working directory, an absolute one, a symbolic link, a mount at another place on
//! another host, the same bucket through another spelling of the URL. What the ranks compare is
//! therefore what was opened, not what was typed: the checkpoint's identity (the digest of its
//! metadata as read), and only where it has none its location made canonical.

use serde::{Deserialize, Serialize};
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
#[cfg(doc)]
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::rendezvous::plan_differences;
use tessera_planner::{PlanOptions, ReadOrder};

use crate::OpsError;
use crate::load::PlanServer;

/// The checkpoint `checkpoint` (opened from `location`) as the ranks of a job compare it: its
/// identity when it has one (every on-disk format records one; two ranks then agree exactly when
/// they opened the same save, wherever they found it, and a checkpoint saved again between their
/// opens is told apart); else `location` made canonical ([`tessera_storage::canonical`]).
pub fn checkpoint_key(checkpoint: &Checkpoint, location: &str) -> Result<String, OpsError> {
    match checkpoint.meta.identity() {
        Some(identity) => Ok(identity.to_string()),
        None => Ok(tessera_storage::canonical(location)?),
    }
}

/// A job's fingerprint for [`RendezvousConfig::job`]: what it loads (`checkpoint_key`, from
/// [`checkpoint_key`]), `parts` that every rank of the job gives alike (the layout or requests
/// as text, for the CLI), and the world. FNV-1a: stable across processes and builds, unlike
/// std's hasher; each part's length goes first, so that ("ab", "c") and ("a", "bc") differ.
pub fn job_fingerprint(checkpoint_key: &str, parts: &[&[u8]], world: u32) -> u64 {
    let world = world.to_le_bytes();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in std::iter::once(checkpoint_key.as_bytes())
        .chain(parts.iter().copied())
        .chain(std::iter::once(&world[..]))
    {
        for byte in (part.len() as u64).to_le_bytes().iter().chain(part) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The plan terms ([`plan_terms`]) of a job that plans on `server`, or here with `planning` (as
/// `checkpoint` plans with them: [`Checkpoint::plan_options`]) and the tensor `filter`; dedup
/// is `planning`'s either way. What every front end gives its rendezvous.
pub fn job_plan_terms(
    checkpoint: &Checkpoint,
    planning: &PlanOptions,
    filter: &[String],
    server: Option<&PlanServer>,
) -> Vec<(String, String)> {
    match server {
        Some(server) => plan_terms(&PlannedBy::Server {
            server,
            dedup: planning.dedup,
        }),
        None => plan_terms(&PlannedBy::Here {
            options: &checkpoint.plan_options(planning),
            filter,
        }),
    }
}

/// What one rank of a job that meets without tessera's rendezvous (a torch process group)
/// tells the others, for [`check_job_terms`]: the same things the rendezvous compares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobTerms {
    /// The checkpoint as the rank named it (for the message).
    pub location: String,
    /// The checkpoint as the rank opened it ([`checkpoint_key`]).
    pub checkpoint: String,
    /// The options of its plan ([`job_plan_terms`]).
    pub plan: Vec<(String, String)>,
}

/// Refuses, on rank `rank`, a job whose ranks (`all`, indexed by rank) load different
/// checkpoints (as opened: another step, or the same path saved again between their opens), or
/// plan with different options: each rank would plan a job its peers do not run, and bytes of
/// one checkpoint would be placed by a plan of the other. Every rank checks the same list, so
/// every rank fails alike, naming the ranks and both checkpoints (or options).
pub fn check_job_terms(rank: u32, all: &[JobTerms]) -> Result<(), OpsError> {
    match terms_refusal(all) {
        Some(refusal) => Err(refusal.error(rank)),
        None => Ok(()),
    }
}

/// Why a job's ranks cannot load together ([`terms_refusal`]): what one rank (the job's
/// coordinator) finds and every rank raises as its own error ([`TermsRefusal::error`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TermsRefusal {
    /// Ranks opened different checkpoints: each `rank r loads A (key) but rank 0 loads B (key)`.
    Checkpoints(Vec<String>),
    /// Ranks plan with different options: each difference, naming the rank and option.
    Options(Vec<String>),
}

impl TermsRefusal {
    /// The error rank `rank` raises.
    pub fn error(&self, rank: u32) -> OpsError {
        match self {
            TermsRefusal::Checkpoints(differences) => OpsError::invalid(format!(
                "rank {rank}: the ranks of this job load different checkpoints: {}; every rank of a \
                 job must load the same checkpoint (nothing was read)",
                differences.join("; ")
            )),
            TermsRefusal::Options(differences) => LoaderError::RanksDisagree {
                rank,
                detail: differences.join("; "),
            }
            .into(),
        }
    }
}

/// The first reason `all` (every rank's terms, by rank) cannot load as one job, against rank
/// 0's; `None` when they agree. At most the first 16 differences of a kind are listed.
pub fn terms_refusal(all: &[JobTerms]) -> Option<TermsRefusal> {
    const LISTED: usize = 16;
    let first = all.first()?;
    let differing: Vec<(usize, &JobTerms)> = all
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, t)| t.checkpoint != first.checkpoint)
        .collect();
    if !differing.is_empty() {
        let mut listed: Vec<String> = differing
            .iter()
            .take(LISTED)
            .map(|(r, t)| {
                format!(
                    "rank {r} loads {} ({}) but rank 0 loads {} ({})",
                    t.location, t.checkpoint, first.location, first.checkpoint
                )
            })
            .collect();
        if differing.len() > LISTED {
            listed.push(format!("{} ranks in all", differing.len()));
        }
        return Some(TermsRefusal::Checkpoints(listed));
    }
    let options: Vec<String> = all
        .iter()
        .enumerate()
        .skip(1)
        .flat_map(|(r, t)| plan_differences(r as u32, &t.plan, &first.plan))
        .take(LISTED)
        .collect();
    (!options.is_empty()).then_some(TermsRefusal::Options(options))
}

/// How a job's plan is made, as far as every rank must make it the same way.
pub enum PlannedBy<'a> {
    /// Every rank plans itself, with `options` as its checkpoint plans with them
    /// ([`Checkpoint::plan_options`]: the store's kind prices the read order), and takes the
    /// tensors `filter` says (the flags as given, `--include ... --exclude ...`; empty: every
    /// tensor).
    Here {
        /// The planner's options.
        options: &'a PlanOptions,
        /// The tensor filter's flags.
        filter: &'a [String],
    },
    /// A tessera server plans, once, for every rank; `dedup` goes with the request.
    Server {
        /// The server.
        server: &'a PlanServer,
        /// Whether pieces are read once and exchanged.
        dedup: bool,
    },
}

/// The options of the plan every rank of a job must share, each under the name a user knows it
/// by, for [`RendezvousConfig::plan`]: where the plan is made, and for a plan made here every
/// planner option (the ones a user sets by their flag or variable, the rest by field name,
/// should a front end ever set them). The read order is what the plan uses: `auto` names the
/// kind of store it is priced for, which decides it chunk by chunk, while an order given
/// outright is the same from any store.
pub fn plan_terms(planned_by: &PlannedBy<'_>) -> Vec<(String, String)> {
    let on_off = |on: bool, off: &str| if on { "on" } else { off }.to_string();
    let mut terms = Vec::new();
    match planned_by {
        PlannedBy::Here { options, filter } => {
            // Every field, by name: a new planner option fails to compile here until it is
            // compared too.
            let PlanOptions {
                dedup,
                read_order,
                slab_bytes,
                slab_alignment,
                holder_read_max_bytes,
                holder_read_min_members,
                joint_checks,
                local_reads,
                block_checksums,
            } = options;
            let read_order = match read_order {
                ReadOrder::Auto if *local_reads => "auto (priced for local files)",
                ReadOrder::Auto => "auto (priced for an object store)",
                ReadOrder::Request => "request",
                ReadOrder::Storage => "storage",
            };
            terms.extend([
                ("plan source", "each rank plans (no --server)".to_string()),
                ("--read-order", read_order.to_string()),
                ("dedup", on_off(*dedup, "off (--no-dedup)")),
                ("TESSERA_JOINT_CHECKS", on_off(*joint_checks, "off (0)")),
                (
                    "--include/--exclude",
                    if filter.is_empty() {
                        "none (every tensor)".to_string()
                    } else {
                        filter.join(" ")
                    },
                ),
                ("slab_bytes", slab_bytes.to_string()),
                ("slab_alignment", slab_alignment.to_string()),
                ("holder_read_max_bytes", holder_read_max_bytes.to_string()),
                (
                    "holder_read_min_members",
                    holder_read_min_members.to_string(),
                ),
                ("block_checksums", block_checksums.to_string()),
            ]);
        }
        PlannedBy::Server { server, dedup } => terms.extend([
            (
                "plan source",
                format!("--server {} as {}", server.url, server.checkpoint_id),
            ),
            ("dedup", on_off(*dedup, "off (--no-dedup)")),
        ]),
    }
    terms
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ranks_that_load_other_checkpoints_or_plan_otherwise_are_named() {
        let terms = |location: &str, checkpoint: &str, order: &str| JobTerms {
            location: location.to_string(),
            checkpoint: checkpoint.to_string(),
            plan: vec![("--read-order".to_string(), order.to_string())],
        };
        let same = [
            terms("run/step-1", "native:a", "auto"),
            terms("/abs/run/step-1", "native:a", "auto"),
        ];
        assert!(check_job_terms(1, &same).is_ok());
        let err = check_job_terms(
            0,
            &[
                terms("run/step-1", "native:a", "auto"),
                terms("run/step-2", "native:b", "auto"),
            ],
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "rank 0: the ranks of this job load different checkpoints: rank 1 loads run/step-2 \
             (native:b) but rank 0 loads run/step-1 (native:a); every rank of a job must load the \
             same checkpoint (nothing was read)"
        );
        let err = check_job_terms(
            1,
            &[
                terms("a", "native:a", "auto"),
                terms("a", "native:a", "storage"),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(
                "rank 1 plans with --read-order storage but rank 0 with --read-order auto"
            ),
            "{err}"
        );
    }

    fn value<'a>(terms: &'a [(String, String)], name: &str) -> &'a str {
        terms
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {name} in {terms:?}"))
    }

    #[test]
    fn plan_terms_name_what_changes_the_plan() {
        let auto_local = PlanOptions {
            local_reads: true,
            ..PlanOptions::default()
        };
        fn here(options: &PlanOptions) -> Vec<(String, String)> {
            plan_terms(&PlannedBy::Here {
                options,
                filter: &[],
            })
        }
        let terms = here(&auto_local);
        assert_eq!(
            value(&terms, "--read-order"),
            "auto (priced for local files)"
        );
        assert_eq!(value(&terms, "dedup"), "on");
        assert_eq!(value(&terms, "--include/--exclude"), "none (every tensor)");
        // The store's kind matters to auto only.
        assert_ne!(here(&PlanOptions::default()), terms);
        let storage = |local_reads| PlanOptions {
            read_order: ReadOrder::Storage,
            local_reads,
            ..PlanOptions::default()
        };
        assert_eq!(here(&storage(true)), here(&storage(false)));
        assert_eq!(value(&here(&storage(true)), "--read-order"), "storage");
        let off = PlanOptions {
            dedup: false,
            joint_checks: false,
            ..PlanOptions::default()
        };
        assert_eq!(value(&here(&off), "dedup"), "off (--no-dedup)");
        assert_eq!(value(&here(&off), "TESSERA_JOINT_CHECKS"), "off (0)");
        let filter = ["--include".to_string(), "model.*".to_string()];
        let filtered = plan_terms(&PlannedBy::Here {
            options: &auto_local,
            filter: &filter,
        });
        assert_eq!(value(&filtered, "--include/--exclude"), "--include model.*");

        let server = PlanServer {
            url: "http://127.0.0.1:1".to_string(),
            checkpoint_id: "run/step-1".to_string(),
            token: Some("secret".to_string()),
        };
        let terms = plan_terms(&PlannedBy::Server {
            server: &server,
            dedup: true,
        });
        assert_eq!(
            value(&terms, "plan source"),
            "--server http://127.0.0.1:1 as run/step-1"
        );
        // The token is no option of the plan, and never leaves the rank.
        assert!(!format!("{terms:?}").contains("secret"));
    }
}
