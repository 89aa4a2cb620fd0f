//! Where a load's rank plans come from: planned here from the opened checkpoint (the default,
//! no service needed), or a tessera server that plans once for the whole job. Either way a
//! plan made for another version of the checkpoint is refused before any rank reads: a server's
//! plan once, when it is created (and each rank plan again when the loader executes it).

use std::sync::Arc;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::plan_client::{CreatedPlan, PlanClient, PlanClientOptions, PlanTarget};

use tessera_metadata::CheckpointMeta;
use tessera_planner::{Plan, PlanOptions, PlanSummary, RankPlan, ReadSources, RequestSet};

use crate::{OpsError, ResultExt};

/// A tessera server that plans instead of the ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanServer {
    /// Its URL (`http(s)://host:port`).
    pub url: String,
    /// The checkpoint's id there (`<run>/<step>`).
    pub checkpoint_id: String,
    /// Its bearer token.
    pub token: Option<String>,
}

impl PlanServer {
    /// The server at `url` planning the checkpoint at `location`: its id there is `checkpoint_id`
    /// when given, else the location's last two components
    /// ([`tessera_loader::plan_client::server_checkpoint_id`]). When neither tells it, the error
    /// names the location and says to give the id as `give_id` (how the front end takes it:
    /// `--checkpoint-id <run>/<step>`, `checkpoint_id="<run>/<step>"`).
    pub fn for_checkpoint(
        url: String,
        location: &str,
        checkpoint_id: Option<String>,
        token: Option<String>,
        give_id: &str,
    ) -> Result<PlanServer, OpsError> {
        let checkpoint_id = checkpoint_id
            .or_else(|| tessera_loader::plan_client::server_checkpoint_id(location))
            .ok_or_else(|| {
                OpsError::invalid(format!(
                    "cannot tell the plan server's id of checkpoint {location:?} (its location \
                     does not end in <run>/<step>): give {give_id}"
                ))
            })?;
        Ok(PlanServer {
            url,
            checkpoint_id,
            token,
        })
    }
}

/// A job's plan: every rank's plan is taken from it.
pub enum JobPlan {
    /// Planned here.
    Local(Plan),
    /// Planned by a server; rank plans are fetched from it.
    Server {
        /// The client that fetches rank plans.
        client: PlanClient,
        /// The server's answer to the plan request.
        created: CreatedPlan,
        /// What was asked, resolved here against the opened checkpoint: each rank plan's
        /// destinations must be its rank's requests ([`RankPlan::check_destinations`]).
        requests: RequestSet,
        /// The opened checkpoint's metadata, which `requests` index.
        meta: Arc<CheckpointMeta>,
    },
}

impl JobPlan {
    /// Plans `requests` against `checkpoint` here.
    /// A live step's plan is replayed when this process planned another step of the same
    /// layout with the same requests and options ([`super::replay`]; the summary says so).
    pub fn local(
        checkpoint: &Checkpoint,
        requests: &RequestSet,
        options: &PlanOptions,
    ) -> Result<JobPlan, OpsError> {
        JobPlan::local_with_sources(checkpoint, requests, options, &ReadSources::none())
    }

    /// [`JobPlan::local`] with copies of data files that ranks hold outside storage (the memory
    /// tiers they found): each held file is read there ([`Checkpoint::plan_with_sources`]).
    pub fn local_with_sources(
        checkpoint: &Checkpoint,
        requests: &RequestSet,
        options: &PlanOptions,
        sources: &ReadSources,
    ) -> Result<JobPlan, OpsError> {
        Ok(JobPlan::Local(super::replay::plan_or_replay(
            checkpoint, requests, options, sources,
        )?))
    }

    /// Whether the plan was replayed from another step of the same layout, not made.
    pub fn replayed(&self) -> bool {
        self.summary().replayed
    }

    /// Has `server` plan `target` for the checkpoint it knows as `server.checkpoint_id`, and
    /// refuses at once (before any rank reads) a plan made for another version of the checkpoint
    /// than the one opened here (`checkpoint`, which the user named `location`), or one that does
    /// not say which version it is for.
    pub async fn on_server(
        checkpoint: &Checkpoint,
        location: &str,
        server: &PlanServer,
        target: &PlanTarget,
        dedup: bool,
    ) -> Result<JobPlan, OpsError> {
        let client = PlanClient::new(
            &server.url,
            PlanClientOptions {
                token: server.token.clone(),
                dedup,
                ..PlanClientOptions::default()
            },
        )?;
        let (id, url) = (&server.checkpoint_id, &server.url);
        let created = client
            .create_plan(id, target)
            .await
            .with_context(|| format!("planning {id} on {url}"))?;
        check_identity(
            created.checkpoint_identity.as_deref(),
            checkpoint.meta.identity(),
            location,
            server,
        )?;
        // As the server resolves them (the same checkpoint, by identity): what each rank's plan
        // must fill, in order.
        let tensors = checkpoint.meta.tensors();
        let requests = match target {
            PlanTarget::Layout(layout) => layout.resolve(tensors),
            PlanTarget::Requests(requests) => requests.resolve(tensors),
        }
        .with_context(|| format!("resolving what was asked of {url} against {location}"))?;
        if requests.world_size() != created.world {
            return Err(OpsError::invalid(format!(
                "{url} planned {id} for {} ranks, but what was asked has {}",
                created.world,
                requests.world_size()
            )));
        }
        Ok(JobPlan::Server {
            client,
            created,
            requests,
            meta: Arc::clone(&checkpoint.meta),
        })
    }

    /// Ranks of the job.
    pub fn world(&self) -> u32 {
        match self {
            JobPlan::Local(plan) => plan.world_size(),
            JobPlan::Server { created, .. } => created.world,
        }
    }

    /// The plan's totals.
    pub fn summary(&self) -> &PlanSummary {
        match self {
            JobPlan::Local(plan) => plan.summary(),
            JobPlan::Server { created, .. } => &created.summary,
        }
    }

    /// Rank `rank`'s plan. A server's is refused unless its destinations are that rank's
    /// requests, in order: the caller's buffers are the requests, and a plan listing two of them
    /// the other way round would fill each with the other's bytes.
    pub async fn rank_plan(&self, rank: u32) -> Result<RankPlan, OpsError> {
        Ok(match self {
            JobPlan::Local(plan) => plan.rank_plan(rank)?,
            JobPlan::Server {
                client,
                created,
                requests,
                meta,
            } => {
                let plan = client
                    .rank_plan(&created.plan, rank)
                    .await
                    .with_context(|| format!("fetching rank {rank}'s plan from the server"))?;
                let Some(mine) = requests.ranks.get(rank as usize) else {
                    return Err(tessera_planner::PlanError::RankOutOfRange {
                        rank,
                        world: requests.world_size(),
                    }
                    .into());
                };
                plan.check_destinations(meta, mine)?;
                plan
            }
        })
    }
}

/// The server's plan is for the checkpoint opened here: its identity (`planned`) is the opened
/// one's (`opened`). A server that names none cannot be checked against a checkpoint that has
/// one, and is refused too.
fn check_identity(
    planned: Option<&str>,
    opened: Option<&str>,
    location: &str,
    server: &PlanServer,
) -> Result<(), OpsError> {
    let (id, url) = (&server.checkpoint_id, &server.url);
    match (planned, opened) {
        (None, Some(opened)) => Err(OpsError::invalid(format!(
            "{url} did not say which version of checkpoint {id} its plan is for (no \
             checkpoint_identity: a server older than this client), so the plan cannot be checked \
             against {location} (identity {opened}); upgrade the server, or load without a server"
        ))),
        (Some(planned), Some(opened)) if planned != opened => Err(OpsError::invalid(format!(
            "the server's plan is for another version of checkpoint {location}: {url} planned \
             {id} with identity {planned}, but the checkpoint opened here has identity {opened} \
             (it was saved again, or the server's {id} is another checkpoint; check the \
             checkpoint id and plan again)"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn server() -> PlanServer {
        PlanServer {
            url: "http://127.0.0.1:1".to_string(),
            checkpoint_id: "run/step-1".to_string(),
            token: None,
        }
    }

    #[test]
    fn a_server_for_a_checkpoint_takes_the_id_given_else_the_location_s_else_says_how_to_give_it() {
        let url = || "http://127.0.0.1:1".to_string();
        let given = PlanServer::for_checkpoint(
            url(),
            "s3://b/runs/a/step-1",
            Some("x/y".to_string()),
            Some("t".to_string()),
            "--checkpoint-id <run>/<step>",
        )
        .unwrap();
        assert_eq!(
            given,
            PlanServer {
                url: url(),
                checkpoint_id: "x/y".to_string(),
                token: Some("t".to_string()),
            }
        );
        let derived =
            PlanServer::for_checkpoint(url(), "s3://b/runs/a/step-1/", None, None, "-").unwrap();
        assert_eq!(derived.checkpoint_id, "a/step-1");
        let err = PlanServer::for_checkpoint(url(), "s3://ck", None, None, "--checkpoint-id X")
            .unwrap_err();
        assert!(matches!(err, OpsError::Invalid { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("\"s3://ck\"") && text.ends_with("give --checkpoint-id X"),
            "{text}"
        );
    }

    #[test]
    fn a_server_plan_for_another_version_or_no_version_is_refused() {
        let s = server();
        assert!(check_identity(Some("a"), Some("a"), "ck", &s).is_ok());
        // Metadata assembled in memory has no identity: nothing to check against.
        assert!(check_identity(Some("a"), None, "ck", &s).is_ok());
        let other = check_identity(Some("b"), Some("a"), "ck", &s)
            .unwrap_err()
            .to_string();
        assert!(
            other.starts_with("the server's plan is for another version of checkpoint ck")
                && other.contains("identity b")
                && other.contains("has identity a"),
            "{other}"
        );
        let none = check_identity(None, Some("a"), "ck", &s)
            .unwrap_err()
            .to_string();
        assert!(
            none.contains("did not say which version of checkpoint run/step-1")
                && none.contains("(identity a)"),
            "{none}"
        );
    }
}
