//! What the job's messages hold and what the coordinator (rank 0) does with them: every rank's
//! hello in, one answer per rank out (its node for the memory tier's round, or its own rank plan
//! from one plan of the whole job), and the verdict on every pair's plan digests. Shared by every
//! front end's [`super::JobWork`].

use std::collections::HashMap;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::plan_client::PlanTarget;
use tessera_loader::tier::Verified;
use tessera_loader::verify::joint;
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, PlanOptions, PlanSummary, RankPlan, ReadSources,
};

use super::PlannedRank;
use crate::OpsError;
use crate::load::agreement::{JobTerms, TermsRefusal, terms_refusal};
use crate::load::{JobPlan, PlanServer};
use crate::memory_tier::{TierOffer, nodes_of, sources_of_verified};

/// What a rank says first (round 1): its requests, its memory-tier offer, and the checkpoint as
/// it opened it with the options it plans with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Its requests, in its destinations' order.
    pub requests: Vec<ExplicitRequest>,
    /// Its node's candidate memory-tier copies (`node` empty: no tier).
    pub tier: TierOffer,
    /// The checkpoint as opened and the plan options.
    pub terms: JobTerms,
}

impl Hello {
    /// As it travels ([`super::packed::to_wire`]: a rank's requests step through boxes evenly).
    pub fn encode(&self) -> Result<Bytes, OpsError> {
        super::packed::to_wire(self, "this rank's hello")
    }

    fn decode(rank: usize, bytes: &[u8]) -> Result<Hello, OpsError> {
        super::packed::from_wire(
            bytes,
            &format!("rank {rank}'s hello (requests, memory-tier offer, checkpoint)"),
        )
    }
}

/// The coordinator's answer to one rank.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Answer {
    /// The ranks cannot load as one job; every rank raises [`TermsRefusal::error`].
    Refused(TermsRefusal),
    /// Verify a share of the node's memory-tier copies first: the ranks of this rank's node
    /// (empty: no tier here).
    VerifyTier(Vec<u32>),
    /// The rank's plan, and what its node's ranks verified of their memory-tier copies (empty
    /// without a tier round).
    Plan {
        /// The rank plan.
        plan: Box<RankPlan>,
        /// The verifications of the node's ranks, this rank's included.
        node_verified: Vec<Verified>,
        /// The coordinator checks every jointly read box (it made the whole plan); otherwise
        /// (a server's plan) each rank checks its own with the other readers' folds.
        joint_at_coordinator: bool,
        /// The whole job's plan in numbers, for a rank's report of the job.
        #[serde(default)]
        summary: Option<PlanSummary>,
    },
}

impl Answer {
    /// As it travels ([`super::packed::to_wire`]: a rank plan's pieces step through ids and
    /// offsets by the same amounts).
    pub fn encode(&self) -> Result<Bytes, OpsError> {
        super::packed::to_wire(self, "an answer to a rank")
    }

    /// Decodes the answer rank `rank` fetched ([`Answer::encode`]).
    pub fn decode(rank: u32, bytes: &[u8]) -> Result<Answer, OpsError> {
        super::packed::from_wire(
            bytes,
            &format!("rank {rank}'s answer from the job's coordinator (rank 0)"),
        )
    }
}

fn json<T: Serialize>(value: &T, what: &str) -> Result<Bytes, OpsError> {
    serde_json::to_vec(value)
        .map(Bytes::from)
        .map_err(|source| OpsError::Message {
            what: what.to_string(),
            source,
        })
}

/// How the coordinator plans: the opened checkpoint and the options every rank agreed on.
pub struct JobCoordinator {
    /// The checkpoint as the coordinator opened it.
    pub checkpoint: Arc<Checkpoint>,
    /// How the user named it.
    pub location: String,
    /// The planner's options.
    pub planning: PlanOptions,
    /// The tessera server that plans instead, if any.
    pub server: Option<PlanServer>,
    /// Whether pieces are read once and exchanged (for a server's plan).
    pub dedup: bool,
    /// Between the two answers of a job with memory tiers: every rank's requests and offer.
    pending: Option<(Vec<Vec<ExplicitRequest>>, Vec<TierOffer>)>,
    /// Every joint check of the plan made here ([`tessera_planner::Plan::joint_checks_view`]),
    /// which the coordinator checks after the reads.
    joint_view: Option<RankPlan>,
}

impl JobCoordinator {
    /// The coordinator of a load of `checkpoint` (named `location`) planned with `planning`, or
    /// by `server`.
    pub fn new(
        checkpoint: Arc<Checkpoint>,
        location: String,
        planning: PlanOptions,
        server: Option<PlanServer>,
        dedup: bool,
    ) -> Self {
        Self {
            checkpoint,
            location,
            planning,
            server,
            dedup,
            pending: None,
            joint_view: None,
        }
    }

    /// Round 1's answers, one per rank in rank order: refused when the ranks opened different
    /// checkpoints or plan otherwise; each rank's node when some rank offered memory-tier
    /// copies; each rank's plan otherwise.
    pub async fn coordinate(&mut self, hellos: &[Bytes]) -> Result<Vec<Bytes>, OpsError> {
        let hellos = hellos
            .iter()
            .enumerate()
            .map(|(r, bytes)| Hello::decode(r, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let terms: Vec<JobTerms> = hellos.iter().map(|h| h.terms.clone()).collect();
        if let Some(refusal) = terms_refusal(&terms) {
            let answer = Answer::Refused(refusal).encode()?;
            return Ok(vec![answer; hellos.len()]);
        }
        let (requests, offers): (Vec<_>, Vec<_>) =
            hellos.into_iter().map(|h| (h.requests, h.tier)).unzip();
        if offers.iter().all(|o| o.node.is_empty()) {
            return self
                .plan_answers(requests, &ReadSources::none(), None)
                .await;
        }
        if let Some(server) = &self.server {
            return Err(crate::memory_tier::refuse_with_server(&format!(
                "server={}",
                server.url
            )));
        }
        let mut node_of = vec![Vec::new(); offers.len()];
        for ranks in nodes_of(&offers).into_values() {
            for &r in &ranks {
                node_of[r as usize] = ranks.clone();
            }
        }
        let answers = node_of
            .into_iter()
            .map(|node| Answer::VerifyTier(node).encode())
            .collect();
        self.pending = Some((requests, offers));
        answers
    }

    /// The answers after the memory tier's round: every rank's plan, planned with each node's
    /// verified copies as sources, and its node's verifications.
    pub async fn settle(&mut self, verified: &[Bytes]) -> Result<Vec<Bytes>, OpsError> {
        let (requests, offers) = self.pending.take().ok_or_else(|| {
            OpsError::invalid("memory-tier verifications without the offers before them")
        })?;
        let verified = verified
            .iter()
            .enumerate()
            .map(|(r, bytes)| {
                serde_json::from_slice::<Verified>(bytes).map_err(|source| OpsError::Message {
                    what: format!("rank {r}'s memory-tier verification"),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sources = sources_of_verified(&offers, &verified)?;
        let mut node_verified = vec![Vec::new(); offers.len()];
        for ranks in nodes_of(&offers).into_values() {
            let theirs: Vec<Verified> = ranks
                .iter()
                .map(|&r| verified[r as usize].clone())
                .collect();
            for &r in &ranks {
                node_verified[r as usize] = theirs.clone();
            }
        }
        self.plan_answers(requests, &sources, Some(node_verified))
            .await
    }

    /// Plans the job once (here, or on the server) and answers each rank with its own rank plan.
    async fn plan_answers(
        &mut self,
        requests: Vec<Vec<ExplicitRequest>>,
        sources: &ReadSources,
        node_verified: Option<Vec<Vec<Verified>>>,
    ) -> Result<Vec<Bytes>, OpsError> {
        let world = requests.len();
        let explicit = ExplicitRequests { ranks: requests };
        let plan = match &self.server {
            Some(server) => {
                JobPlan::on_server(
                    &self.checkpoint,
                    &self.location,
                    server,
                    &PlanTarget::Requests(explicit),
                    self.dedup,
                )
                .await?
            }
            None => {
                let set = explicit.resolve(self.checkpoint.meta.tensors())?;
                JobPlan::local_with_sources(&self.checkpoint, &set, &self.planning, sources)?
            }
        };
        self.joint_view = match &plan {
            JobPlan::Local(plan) => Some(plan.joint_checks_view()),
            JobPlan::Server { .. } => None,
        };
        let joint_at_coordinator = self.joint_view.is_some();
        let summary = plan.summary().clone();
        let node_verified = node_verified.unwrap_or_default();
        let answer = |rank: u32, plan: RankPlan| {
            Answer::Plan {
                plan: Box::new(plan),
                node_verified: node_verified
                    .get(rank as usize)
                    .cloned()
                    .unwrap_or_default(),
                joint_at_coordinator,
                summary: Some(summary.clone()),
            }
            .encode()
        };
        match &plan {
            // Cutting and packing every rank's plan is the coordinator's other O(world) work
            // beside planning: spread over the cores it has.
            JobPlan::Local(local) => {
                in_parallel(world, |rank| answer(rank, local.rank_plan(rank)?))
            }
            JobPlan::Server { .. } => {
                let mut answers = Vec::with_capacity(world);
                for rank in 0..world as u32 {
                    answers.push(answer(rank, plan.rank_plan(rank).await?)?);
                }
                Ok(answers)
            }
        }
    }
}

/// `each(rank)` for ranks `0..world` on this machine's cores (each thread takes every n-th
/// rank), in rank order; the first error in rank order wins.
fn in_parallel(
    world: usize,
    each: impl Fn(u32) -> Result<Bytes, OpsError> + Sync,
) -> Result<Vec<Bytes>, OpsError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, world.max(1));
    let mut results: Vec<Option<Result<Bytes, OpsError>>> = (0..world).map(|_| None).collect();
    std::thread::scope(|scope| {
        let each = &each;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    (t..world)
                        .step_by(threads)
                        .map(|rank| (rank, each(rank as u32)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for handle in handles {
            match handle.join() {
                Ok(done) => {
                    for (rank, result) in done {
                        results[rank] = Some(result);
                    }
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    results
        .into_iter()
        .enumerate()
        .map(|(rank, result)| {
            result.unwrap_or_else(|| {
                Err(OpsError::invalid(format!(
                    "rank {rank}'s answer was not made"
                )))
            })
        })
        .collect()
}

impl JobCoordinator {
    /// Round 6 where the coordinator made the plan: checks every jointly read box of the job
    /// against the folds of its readers (`folds[r]`: rank r's folds message, `None` when it read
    /// no part of one), naming the box, its file and readers when the parts do not add up to its
    /// checksum. `verify`: the load verifies (without it nothing is folded or checked).
    pub fn check_joint(&self, folds: &[Option<Bytes>], verify: bool) -> Result<(), OpsError> {
        let Some(view) = &self.joint_view else {
            return Err(OpsError::invalid(
                "the coordinator was asked to check the jointly read boxes of a plan it did not make",
            ));
        };
        let mut by_rank = joint::FoldsByRank::new();
        for (rank, data) in folds.iter().enumerate() {
            if let Some(data) = data {
                by_rank.insert(rank as u32, joint::decode(0, rank as u32, data, None)?);
            }
        }
        joint::check_joint_boxes(view, Some(&self.checkpoint.meta), &by_rank, verify)?;
        Ok(())
    }
}

/// What a rank reports of its plan for the agreement: the digest of a pair that passes nothing,
/// then each peer it passes something and the digest of that ([`RankPlan::pair_digests`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PairReport {
    /// [`RankPlan::empty_pair_digest`].
    pub empty: u64,
    /// Peer and digest, ascending by peer.
    pub pairs: Vec<(u32, u64)>,
}

impl PairReport {
    /// The report of `plan`.
    pub fn of(plan: &RankPlan) -> Self {
        Self {
            empty: plan.empty_pair_digest(),
            pairs: plan.pair_digests(),
        }
    }

    /// 8 bytes of `empty`, then 12 per pair (little-endian).
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(8 + 12 * self.pairs.len());
        out.put_u64_le(self.empty);
        for &(peer, digest) in &self.pairs {
            out.put_u32_le(peer);
            out.put_u64_le(digest);
        }
        out.freeze()
    }

    fn decode(rank: usize, mut bytes: &[u8]) -> Result<Self, OpsError> {
        if bytes.len() < 8 || !(bytes.len() - 8).is_multiple_of(12) {
            return Err(OpsError::invalid(format!(
                "rank {rank}'s plan digests are {} bytes, not 8 + 12 per peer",
                bytes.len()
            )));
        }
        let empty = bytes.get_u64_le();
        let mut pairs = Vec::with_capacity(bytes.len() / 12);
        while bytes.has_remaining() {
            pairs.push((bytes.get_u32_le(), bytes.get_u64_le()));
        }
        Ok(Self { empty, pairs })
    }
}

/// The coordinator's verdict on the plan: the pairs of ranks whose plans describe what they pass
/// each other differently (the first 16, and how many in all).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Pairs `(a, b)`, `a < b`, that disagree.
    pub disagree: Vec<(u32, u32)>,
    /// How many pairs disagree in all.
    pub count: usize,
}

impl Verdict {
    /// Compares both ends of every pair some rank reported (`reports[r]`: rank r's
    /// [`PairReport`], encoded); a pair one end does not list digests as that end's empty pair.
    pub fn of_reports(reports: &[Bytes]) -> Result<Verdict, OpsError> {
        const LISTED: usize = 16;
        let reports = reports
            .iter()
            .enumerate()
            .map(|(r, bytes)| PairReport::decode(r, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let world = reports.len() as u32;
        let mut said: HashMap<(u32, u32), u64> = HashMap::new();
        for (rank, report) in reports.iter().enumerate() {
            for &(peer, digest) in &report.pairs {
                said.insert((rank as u32, peer), digest);
            }
        }
        let view = |a: u32, b: u32| -> Option<u64> {
            said.get(&(a, b))
                .copied()
                .or_else(|| reports.get(a as usize).map(|r| r.empty))
        };
        let mut disagree: Vec<(u32, u32)> = said
            .keys()
            .map(|&(a, b)| (a.min(b), a.max(b)))
            .filter(|&(a, b)| b >= world || view(a, b) != view(b, a))
            .collect();
        disagree.sort_unstable();
        disagree.dedup();
        let count = disagree.len();
        disagree.truncate(LISTED);
        Ok(Verdict { disagree, count })
    }

    /// JSON bytes.
    pub fn encode(&self) -> Result<Bytes, OpsError> {
        json(self, "the plan's verdict")
    }

    /// Rank `rank`'s outcome of the verdict (`bytes`): its own error naming the peers it
    /// disagrees with, or the pairs that disagree elsewhere.
    pub fn accept(rank: u32, bytes: &[u8]) -> Result<(), OpsError> {
        let verdict: Verdict =
            serde_json::from_slice(bytes).map_err(|source| OpsError::Message {
                what: format!(
                    "rank {rank}'s verdict on the plan from the job's coordinator (rank 0)"
                ),
                source,
            })?;
        if verdict.count == 0 {
            return Ok(());
        }
        let mine: Vec<u32> = verdict
            .disagree
            .iter()
            .filter_map(|&(a, b)| match (a == rank, b == rank) {
                (true, _) => Some(b),
                (_, true) => Some(a),
                _ => None,
            })
            .collect();
        if !mine.is_empty() {
            let peers = tessera_loader::exchange::agree::ranks_text(&mine);
            return Err(LoaderError::PlansDisagree { rank, peers }.into());
        }
        let pairs: Vec<String> = verdict
            .disagree
            .iter()
            .map(|(a, b)| format!("{a} and {b}"))
            .collect();
        Err(OpsError::invalid(format!(
            "rank {rank}: the plans of ranks {} disagree on what they pass each other ({} pairs \
             in all): the ranks hold rank plans of different plans (nothing was read)",
            pairs.join("; "),
            verdict.count
        )))
    }
}

/// What the rounds after the plan need of rank plan `plan`: its pair digests, and for the joint
/// checks whether it has any, whose folds it needs (the other readers of the boxes it checks,
/// when each rank checks its own) and whether it puts its own (it reads parts of such boxes).
/// `joint_at_coordinator`: the coordinator checks every box ([`JobCoordinator::check_joint`]).
pub fn planned_rank(plan: &RankPlan, joint_at_coordinator: bool) -> PlannedRank {
    let me = plan.rank;
    let mut fold_from: Vec<u32> = if joint_at_coordinator {
        Vec::new()
    } else {
        plan.joint_checks
            .iter()
            .flat_map(|c| c.readers.iter().copied())
            .filter(|&r| r != me)
            .collect()
    };
    fold_from.sort_unstable();
    fold_from.dedup();
    let shares_folds = plan.joint_checks.iter().any(|c| {
        c.readers.contains(&me) && (joint_at_coordinator || c.members.iter().any(|&m| m != me))
    });
    PlannedRank {
        pairs: PairReport::of(plan).encode(),
        fold_from,
        shares_folds,
        has_joint_checks: !plan.joint_checks.is_empty(),
        joint_at_coordinator,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn report(empty: u64, pairs: &[(u32, u64)]) -> Bytes {
        PairReport {
            empty,
            pairs: pairs.to_vec(),
        }
        .encode()
    }

    #[test]
    fn pairs_are_compared_at_both_ends_and_a_one_sided_pair_is_refused() {
        // 0 and 1 agree; 2 thinks it passes 3 something that 3's plan does not list.
        let reports = [
            report(10, &[(1, 5)]),
            report(11, &[(0, 5)]),
            report(12, &[(3, 7)]),
            report(13, &[]),
        ];
        let verdict = Verdict::of_reports(&reports).unwrap();
        assert_eq!(
            verdict,
            Verdict {
                disagree: vec![(2, 3)],
                count: 1
            }
        );
        let bytes = verdict.encode().unwrap();
        let err = Verdict::accept(3, &bytes).unwrap_err().to_string();
        assert!(
            err.starts_with("rank 3: this rank's plan and the plan of rank 2 disagree"),
            "{err}"
        );
        let err = Verdict::accept(0, &bytes).unwrap_err().to_string();
        assert!(
            err.starts_with("rank 0: the plans of ranks 2 and 3 disagree"),
            "{err}"
        );
        let honest = [report(1, &[(1, 9)]), report(1, &[(0, 9)])];
        let verdict = Verdict::of_reports(&honest).unwrap();
        assert!(Verdict::accept(1, &verdict.encode().unwrap()).is_ok());
    }

    #[test]
    fn a_report_that_does_not_decode_names_its_rank() {
        let err = Verdict::of_reports(&[report(1, &[]), Bytes::from_static(b"short")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 1's plan digests are 5 bytes"), "{err}");
    }
}
