//! One rank's local work in the job's rounds, written once for every front end: the coordinator's
//! planning (rank 0), taking this rank's answer (its memory-tier view, its plan checked against
//! its own requests), its share of its node's memory-tier copies, the verdict on the plan and the
//! joint checks. A front end keeps what is its own around it (the torch job's arrays and GIL, the
//! CLI's buffers and transport): [`RankWork`] holds no I/O but the coordinator's planning, which
//! is async (a plan server may plan) and runs inside [`RankWork::step`].

use std::sync::Arc;

use bytes::Bytes;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::tier::{TierCopies, Verified};
use tessera_loader::verify::joint::{self, JointFold};
use tessera_planner::{ExplicitRequest, ExplicitRequests, PlanSummary, RankPlan};

use super::machine::Next;
use super::{
    Answer, Event, JobCoordinator, Planning, RankRounds, RoundSteps, Taken, Verdict, planned_rank,
};
use crate::OpsError;
use crate::memory_tier::TierLoad;

/// What one rank of a job knows and does in the rounds: its checkpoint (as opened, then as seen
/// through its node's verified memory-tier copies), its requests, its tier, the coordinator on
/// rank 0, and once taken its plan; after its read, its folds of boxes read in parts.
pub struct RankWork {
    rank: u32,
    world: u32,
    checkpoint: Arc<Checkpoint>,
    requests: Vec<ExplicitRequest>,
    verify: bool,
    tier: TierLoad,
    tier_copies: TierCopies,
    coordinator: Option<JobCoordinator>,
    plan: Option<Arc<RankPlan>>,
    /// The whole job's plan in numbers, as the coordinator sent it with this rank's plan.
    summary: Option<PlanSummary>,
    /// This rank's folds of the boxes it read in parts, and whether its read verified (folded).
    folds: Option<(bool, Vec<JointFold>)>,
    joint_checked: bool,
}

impl RankWork {
    /// Rank `rank` of `world`, loading `requests` (its destinations, in order) from
    /// `checkpoint` as opened, offering `tier`'s copies; `verify`: its read verifies what the
    /// checkpoint has checksums of.
    pub fn new(
        rank: u32,
        world: u32,
        checkpoint: Arc<Checkpoint>,
        requests: Vec<ExplicitRequest>,
        tier: TierLoad,
        verify: bool,
    ) -> Self {
        Self {
            rank,
            world,
            checkpoint,
            requests,
            verify,
            tier,
            tier_copies: TierCopies::default(),
            coordinator: None,
            plan: None,
            summary: None,
            folds: None,
            joint_checked: false,
        }
    }

    /// Makes this rank the job's coordinator (rank 0 does it: it plans for every rank).
    pub fn coordinate_with(&mut self, coordinator: JobCoordinator) {
        self.coordinator = Some(coordinator);
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The checkpoint as this rank reads it (through its node's verified memory-tier copies once
    /// its plan is taken).
    pub fn checkpoint(&self) -> &Arc<Checkpoint> {
        &self.checkpoint
    }

    /// This rank's requests.
    pub fn requests(&self) -> &[ExplicitRequest] {
        &self.requests
    }

    /// This rank's memory tier (its offer).
    pub fn tier(&self) -> &TierLoad {
        &self.tier
    }

    /// The memory-tier copies this rank reads, and those its node did not take (with why).
    pub fn tier_copies(&self) -> &TierCopies {
        &self.tier_copies
    }

    /// Whether this rank's read verifies (and so folds its parts of jointly checked boxes).
    pub fn verifying(&self) -> bool {
        self.checkpoint.verifies(self.verify)
    }

    /// This rank's plan as the coordinator made it, once taken.
    pub fn plan(&self) -> Option<&Arc<RankPlan>> {
        self.plan.as_ref()
    }

    /// The whole job's plan in numbers, once this rank's plan is taken.
    pub fn job_summary(&self) -> Option<&PlanSummary> {
        self.summary.as_ref()
    }

    /// Whether the boxes this rank read or received in parts were checked (here or at the
    /// coordinator): the rounds reached the exchange.
    pub fn joint_checked(&self) -> bool {
        self.joint_checked
    }

    /// This rank read its pieces: its folds of the boxes it read in parts, kept for its joint
    /// checks, and encoded as the rounds put them ([`Event::Read`]).
    pub fn read_done(&mut self, folds: Vec<JointFold>) -> Bytes {
        let verifying = self.verifying();
        let encoded = joint::encode(verifying, &folds);
        self.folds = Some((verifying, folds));
        encoded
    }

    fn coordinator(&mut self) -> Result<&mut JobCoordinator, OpsError> {
        let rank = self.rank;
        self.coordinator.as_mut().ok_or_else(|| {
            OpsError::invalid(format!(
                "rank {rank}: asked to coordinate the job, which rank 0 does"
            ))
        })
    }

    /// The coordinator's answers to every rank's hello ([`JobCoordinator::coordinate`]).
    pub async fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        self.coordinator()?.coordinate(&hellos).await
    }

    /// The coordinator's answers once every rank verified its memory-tier share
    /// ([`JobCoordinator::settle`]).
    pub async fn settle(&mut self, verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        self.coordinator()?.settle(&verified).await
    }

    /// Takes this rank's answer: a refusal as this rank's error, its node to verify, or its plan
    /// (with its node's verified memory-tier copies), checked against its own requests.
    pub fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError> {
        let rank = self.rank;
        match Answer::decode(rank, &answer)? {
            Answer::Refused(refusal) => Err(refusal.error(rank)),
            Answer::VerifyTier(node) => Ok(Taken::VerifyTier(node)),
            Answer::Plan {
                plan,
                node_verified,
                joint_at_coordinator,
                summary,
            } => {
                if !node_verified.is_empty() {
                    let theirs: Vec<&Verified> = node_verified.iter().collect();
                    let (view, copies) = self.tier.accept_node(&self.checkpoint, &theirs)?;
                    self.checkpoint = Arc::new(view);
                    self.tier_copies = copies;
                }
                self.check_plan(&plan)?;
                let planned = planned_rank(&plan, joint_at_coordinator);
                self.plan = Some(Arc::new(*plan));
                self.summary = summary;
                Ok(Taken::Planned(planned))
            }
        }
    }

    /// Refuses a plan that is not this rank's, or whose destinations are not its requests.
    fn check_plan(&self, plan: &RankPlan) -> Result<(), OpsError> {
        let rank = self.rank;
        if plan.rank != rank || plan.world != self.world {
            return Err(OpsError::invalid(format!(
                "rank {rank}: the coordinator sent the plan of rank {} of {} ranks to rank {rank} of {}",
                plan.rank, plan.world, self.world
            )));
        }
        let mine = ExplicitRequests {
            ranks: vec![self.requests.clone()],
        }
        .resolve(self.checkpoint.meta.tensors())?;
        if let Some(requests) = mine.ranks.first() {
            plan.check_destinations(&self.checkpoint.meta, requests)?;
        }
        Ok(())
    }

    /// Verifies this rank's share of its node's (`node`) memory-tier copies; what verified,
    /// encoded.
    pub fn verify_tier(&self, node: &[u32]) -> Result<Bytes, OpsError> {
        let rank = self.rank;
        let verified = self.tier.verify_in_node(&self.checkpoint.meta, node, rank);
        serde_json::to_vec(&verified)
            .map(Bytes::from)
            .map_err(|source| OpsError::Message {
                what: format!("rank {rank}'s memory-tier verification"),
                source,
            })
    }

    /// The coordinator's verdict on every rank's pair digests.
    pub fn agree(&self, reports: &[Bytes]) -> Result<Bytes, OpsError> {
        Verdict::of_reports(reports)?.encode()
    }

    /// Takes the verdict: this rank's error when it refuses the plan.
    pub fn accept(&self, verdict: &[u8]) -> Result<(), OpsError> {
        Verdict::accept(self.rank, verdict)
    }

    /// Checks the boxes this rank checks jointly against its own folds and the other readers'
    /// (`folds`: each reader's, encoded).
    pub fn check_joint(&mut self, folds: &[(u32, Bytes)]) -> Result<(), OpsError> {
        let rank = self.rank;
        let plan = self.plan.as_ref().ok_or_else(|| {
            OpsError::invalid(format!(
                "rank {rank}: checking jointly read boxes before the plan"
            ))
        })?;
        let Some(own) = &self.folds else {
            return Err(OpsError::invalid(format!(
                "rank {rank}: checking jointly read boxes before this rank read its own pieces"
            )));
        };
        let mut by_rank = joint::FoldsByRank::new();
        by_rank.insert(rank, own.clone());
        for (peer, data) in folds {
            by_rank.insert(*peer, joint::decode(rank, *peer, data, None)?);
        }
        joint::check_joint_boxes(
            plan,
            Some(&self.checkpoint.meta),
            &by_rank,
            self.verifying(),
        )?;
        self.joint_checked = true;
        Ok(())
    }

    /// The coordinator: checks every jointly read box of the job against every rank's folds.
    pub fn check_joint_all(&self, folds: &[Option<Bytes>]) -> Result<(), OpsError> {
        let coordinator = self.coordinator.as_ref().ok_or_else(|| {
            OpsError::invalid(format!(
                "rank {}: asked to check every jointly read box, which rank 0 does",
                self.rank
            ))
        })?;
        coordinator.check_joint(folds, self.verifying())
    }

    /// Records that the rounds reached the exchange: the joint checks passed, here or at the
    /// coordinator.
    pub fn reached_exchange(&mut self) {
        self.joint_checked = true;
    }
}

/// The rounds' local work for a front end on an async runtime ([`super::JobWork`] with the
/// coordinator's planning awaited): [`RankWork`] is the one every front end uses; tests wrap it
/// to play a rank that lies.
pub trait AsyncJobWork: RoundSteps + Send {
    /// The coordinator's answers to every rank's hello.
    fn coordinate(
        &mut self,
        hellos: Vec<Bytes>,
    ) -> impl Future<Output = Result<Vec<Bytes>, OpsError>> + Send;
    /// The coordinator's answers once every rank verified its memory-tier share.
    fn settle(
        &mut self,
        verified: Vec<Bytes>,
    ) -> impl Future<Output = Result<Vec<Bytes>, OpsError>> + Send;
    /// The rounds reached the exchange (the joint checks passed, here or at the coordinator).
    fn reached_exchange(&mut self);
}

impl RoundSteps for RankWork {
    fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError> {
        RankWork::take(self, answer)
    }
    fn verify_tier(&mut self, node: Vec<u32>) -> Result<Bytes, OpsError> {
        RankWork::verify_tier(self, &node)
    }
    fn agree(&mut self, reports: Vec<Bytes>) -> Result<Bytes, OpsError> {
        RankWork::agree(self, &reports)
    }
    fn accept(&mut self, verdict: Bytes) -> Result<(), OpsError> {
        RankWork::accept(self, &verdict)
    }
    fn check_joint(&mut self, folds: Vec<(u32, Bytes)>) -> Result<(), OpsError> {
        RankWork::check_joint(self, &folds)
    }
    fn check_joint_all(&mut self, folds: Vec<Option<Bytes>>) -> Result<(), OpsError> {
        RankWork::check_joint_all(self, &folds)
    }
}

impl AsyncJobWork for RankWork {
    async fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        RankWork::coordinate(self, hellos).await
    }
    async fn settle(&mut self, verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        RankWork::settle(self, verified).await
    }
    fn reached_exchange(&mut self) {
        RankWork::reached_exchange(self)
    }
}

impl RankRounds {
    /// [`RankRounds::step`] for a front end that runs on an async runtime: the next actions
    /// after `event`, with the rounds' local work done by `work` (the coordinator's planning
    /// awaited, not blocked on). An error is this rank's failure in [`RankRounds::round`].
    pub async fn step_async<W: AsyncJobWork>(
        &mut self,
        work: &mut W,
        event: Event,
    ) -> Result<Vec<super::Action>, OpsError> {
        let mut next = self.on(event)?;
        loop {
            let todo = match next {
                Next::Actions(actions) => {
                    if actions.iter().any(|a| matches!(a, super::Action::Exchange)) {
                        work.reached_exchange();
                    }
                    return Ok(actions);
                }
                Next::Work(todo) => todo,
            };
            next = match self.do_step(work, todo)? {
                Ok(next) => next,
                Err(Planning::Coordinate(hellos)) => {
                    let answers = work.coordinate(hellos).await?;
                    self.answered(answers)?
                }
                Err(Planning::Settle(verified)) => {
                    let answers = work.settle(verified).await?;
                    self.answered(answers)?
                }
            };
        }
    }
}
