//! A load job's rounds, written once: what the ranks of a job say to each other before the first
//! byte of the exchange moves, as a state machine with no I/O of its own ([`RankRounds`], the
//! way `tessera_loader::exchange::protocol` is the exchange's). A front end pumps it over its
//! channel (the torch job's c10d store from Python, an in-memory board in tests and in the scale
//! simulation): the machine says what to put, which keys to fetch or wait for, where every rank
//! must arrive; the front end's [`JobWork`] does the local steps ([`RankRounds::step`] runs them inline).
//!
//! The rounds, numbered as in the docs (ARCHITECTURE.md "The load job"):
//!
//! 1. **requests** ([`Round::Requests`]): every rank puts its hello (its requests, its memory-tier
//!    offer, the checkpoint as opened and its plan options) under its own key and arrives. The
//!    coordinator (rank 0) fetches every hello, refuses a job whose ranks opened different
//!    checkpoints or plan otherwise (every rank raises its own error naming both), and answers
//!    each rank under its own key.
//! 2. **tier verification** ([`Round::TierVerification`], only where some rank offered a memory
//!    tier): the answer names the ranks of the rank's node; each verifies its share of the
//!    node's copies, puts what verified and arrives; the coordinator plans with every node's
//!    verified copies and answers each rank with its node's verifications and its plan.
//! 3. **plan** ([`Round::Plan`]): the coordinator plans the whole job once (here, or on a
//!    tessera server that planned it) and each rank fetches only its own rank plan, checks it
//!    against its own requests and the opened checkpoint, and puts the digests of what it
//!    passes each of its peers ([`tessera_planner::RankPlan::pair_digests`]).
//! 4. **plan agreement** ([`Round::PlanAgreement`]): the coordinator compares both ends of every
//!    pair any rank reported and answers one verdict every rank fetches: rank plans of
//!    different plans (a server that lies across ranks) are refused before any read.
//! 5. **read** ([`Round::Read`]): every rank reads its own pieces (verified) and puts its folds of
//!    the saved boxes it read in parts.
//! 6. **joint checks** ([`Round::JointChecks`]): where the coordinator made the plan, it fetches
//!    every rank's folds, checks every jointly read box and puts one word every rank waits for
//!    (so no rank fetches the folds of every other reader: in an all-to-all reshard each box is
//!    read in as many parts as there are ranks); with a server's plan each rank fetches the folds
//!    of the other readers of the boxes it holds bytes of, checks them and arrives.
//! 7. **exchange**: [`Action::Exchange`] hands over to the exchange protocol on the job's own
//!    transport; then the report.
//!
//! Cost: a rank puts its own hello, pair digests and folds, and fetches its own answer (its rank
//! plan, compressed) and two short words (the verdict, the joint checks): what it reads from the
//! channel grows with its own plan, not with the job. The coordinator fetches every hello, pair
//! report and folds message and puts every rank's answer: O(world) in all. The per-rank cost of
//! each arrival is one counter and a poll of one key.

mod coordinator;
pub mod host;
mod machine;
pub mod memory_board;
pub mod packed;
mod rank_work;
pub mod transport_board;

pub use coordinator::{Answer, Hello, JobCoordinator, PairReport, Verdict, planned_rank};
pub use machine::RankRounds;
pub use memory_board::JobFailure;
pub use rank_work::{AsyncJobWork, RankWork};

use bytes::Bytes;

use crate::OpsError;

/// The rounds of a load job, in order (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Round {
    /// 1: hellos to the coordinator, its answers.
    Requests,
    /// 2: each node's memory-tier copies verified by its ranks.
    TierVerification,
    /// 3: each rank's plan, taken and digested pairwise.
    Plan,
    /// 4: the coordinator's verdict on every pair's digests.
    PlanAgreement,
    /// 5: each rank's reads, and its folds of boxes read in parts.
    Read,
    /// 6: the jointly read boxes checked.
    JointChecks,
}

impl Round {
    /// The round's number in the docs.
    pub fn number(self) -> u32 {
        self as u32 + 1
    }

    /// What a rank does in this round, as errors name it ("rank 3 failed {step}").
    pub fn step(self) -> &'static str {
        match self {
            Round::Requests => "preparing its requests",
            Round::TierVerification => "verifying its memory-tier copies",
            Round::Plan => "planning its pieces",
            Round::PlanAgreement => "agreeing on the plan",
            Round::Read => "reading its pieces",
            Round::JointChecks => "checking the saved boxes read in parts",
        }
    }

    /// The short name used in channel keys.
    pub fn key_name(self) -> &'static str {
        match self {
            Round::Requests => "requests",
            Round::TierVerification => "tier",
            Round::Plan => "plan",
            Round::PlanAgreement => "agreement",
            Round::Read => "read",
            Round::JointChecks => "joint",
        }
    }
}

/// What the machine asks of its front end. Keys are relative to the load (the channel adds its
/// own prefix: one load's keys never meet another's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Store `value` under `key` (written once, by this rank).
    Put {
        /// The key.
        key: String,
        /// Its value.
        value: Bytes,
    },
    /// Wait until every rank arrived at `round` (after each put what it puts in that round);
    /// answered by [`Event::Arrived`].
    Arrive {
        /// The round.
        round: Round,
    },
    /// Fetch `keys` now (after an arrival, so every rank that writes one has written it); a key
    /// no rank wrote reads as `None`. Answered by [`Event::Got`], in order.
    Get {
        /// The keys.
        keys: Vec<String>,
        /// The round, for errors.
        round: Round,
    },
    /// Wait until `key` is written (by the coordinator), then fetch it; answered by
    /// [`Event::Got`] with one value.
    Await {
        /// The key.
        key: String,
        /// The round, for errors.
        round: Round,
    },
    /// Read this rank's pieces (the front end's own pipeline, with its progress and
    /// cancellation); answered by [`Event::Read`] with this rank's folds.
    Read,
    /// Everything before the exchange is agreed: run it.
    Exchange,
}

/// What the front end tells the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Every rank arrived.
    Arrived,
    /// The values of a [`Action::Get`] or [`Action::Await`], in order.
    Got(Vec<Option<Bytes>>),
    /// This rank read its pieces; its folds of boxes read in parts (empty: none to share).
    Read(Bytes),
}

/// Local work a round needs, done by the front end ([`JobWork`]) between the machine's steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Work {
    /// The coordinator: every rank's hello, in rank order.
    Coordinate(Vec<Bytes>),
    /// The coordinator: every rank's memory-tier verification, in rank order.
    Settle(Vec<Bytes>),
    /// This rank: its answer from the coordinator.
    Take(Bytes),
    /// This rank: its node's ranks, to verify its share of the node's copies.
    VerifyTier(Vec<u32>),
    /// The coordinator: every rank's pair digests, in rank order.
    Agree(Vec<Bytes>),
    /// This rank: the coordinator's verdict on the plan.
    Accept(Bytes),
    /// This rank: the folds of the readers it shares jointly checked boxes with.
    CheckJoint(Vec<(u32, Bytes)>),
    /// The coordinator: every rank's folds (`None`: it read no part of a jointly checked box).
    CheckJointAll(Vec<Option<Bytes>>),
}

/// What taking an answer gave this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Taken {
    /// Verify a share of the node's memory-tier copies (round 2) first.
    VerifyTier(Vec<u32>),
    /// The plan is taken.
    Planned(PlannedRank),
}

/// A rank's side of the plan, as the rounds after it need it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlannedRank {
    /// The digests of what it passes each of its peers, encoded ([`PairReport`]).
    pub pairs: Bytes,
    /// The readers (other than this rank) of the boxes it checks jointly: whose folds it needs.
    pub fold_from: Vec<u32>,
    /// Whether this rank puts its folds (it reads parts of jointly checked boxes).
    pub shares_folds: bool,
    /// Whether its plan has joint checks (it checks them, with or without other readers).
    pub has_joint_checks: bool,
    /// The coordinator checks every jointly read box; the rank waits for its word.
    pub joint_at_coordinator: bool,
}

/// The local steps of a load job on one rank that every front end does alike, whether it runs
/// the rounds on a thread ([`JobWork`]) or on an async runtime ([`AsyncJobWork`]): all but the
/// coordinator's planning, which one blocks on and the other awaits.
pub trait RoundSteps {
    /// Takes this rank's answer.
    fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError>;
    /// Verifies this rank's share of its node's copies; what verified, encoded.
    fn verify_tier(&mut self, node: Vec<u32>) -> Result<Bytes, OpsError>;
    /// The coordinator's verdict on every rank's pair digests, encoded ([`Verdict`]).
    fn agree(&mut self, reports: Vec<Bytes>) -> Result<Bytes, OpsError>;
    /// Takes the verdict; an error when it refuses the plan.
    fn accept(&mut self, verdict: Bytes) -> Result<(), OpsError>;
    /// Checks the boxes this rank checks jointly against the other readers' folds.
    fn check_joint(&mut self, folds: Vec<(u32, Bytes)>) -> Result<(), OpsError>;
    /// The coordinator: checks every jointly read box of the job against every rank's folds.
    fn check_joint_all(&mut self, folds: Vec<Option<Bytes>>) -> Result<(), OpsError>;
}

/// The local steps of a load job on one rank, as a front end that runs the rounds on a thread
/// does them: the coordinator's planning, and the [`RoundSteps`].
pub trait JobWork: RoundSteps {
    /// The coordinator's answers (one per rank, in rank order) to every rank's hello.
    fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError>;
    /// The coordinator's answers once every rank verified its memory-tier share.
    fn settle(&mut self, verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError>;
}

/// What [`RankRounds::do_step`] leaves to the front end: the coordinator's planning, done
/// blocking or awaited, whose answers go to [`RankRounds::answered`].
enum Planning {
    /// Answer every rank's hello ([`JobWork::coordinate`]).
    Coordinate(Vec<Bytes>),
    /// Answer once every rank verified its memory-tier share ([`JobWork::settle`]).
    Settle(Vec<Bytes>),
}

impl RankRounds {
    /// The next actions after `event`, with any local work the rounds need done by `work` here:
    /// the front end only moves what this returns over its channel and reads when asked. An
    /// error is this rank's failure in [`RankRounds::round`].
    pub fn step<W: JobWork + ?Sized>(
        &mut self,
        work: &mut W,
        event: Event,
    ) -> Result<Vec<Action>, OpsError> {
        let mut next = self.on(event)?;
        loop {
            let todo = match next {
                machine::Next::Actions(actions) => return Ok(actions),
                machine::Next::Work(todo) => todo,
            };
            next = match self.do_step(work, todo)? {
                Ok(next) => next,
                Err(Planning::Coordinate(hellos)) => {
                    let answers = work.coordinate(hellos)?;
                    self.answered(answers)?
                }
                Err(Planning::Settle(verified)) => {
                    let answers = work.settle(verified)?;
                    self.answered(answers)?
                }
            };
        }
    }

    /// Does `todo` with `work` and reports it to the machine, unless it is the coordinator's
    /// planning, which comes back (`Err`) for the front end to do its way: the one dispatch of
    /// [`RankRounds::step`] and [`RankRounds::step_async`].
    fn do_step<W: RoundSteps + ?Sized>(
        &mut self,
        work: &mut W,
        todo: Work,
    ) -> Result<Result<machine::Next, Planning>, OpsError> {
        Ok(Ok(match todo {
            Work::Coordinate(hellos) => return Ok(Err(Planning::Coordinate(hellos))),
            Work::Settle(verified) => return Ok(Err(Planning::Settle(verified))),
            Work::Take(answer) => {
                let taken = work.take(answer)?;
                self.took(taken)?
            }
            Work::VerifyTier(node) => {
                let verified = work.verify_tier(node)?;
                self.verified(verified)?
            }
            Work::Agree(reports) => {
                let verdict = work.agree(reports)?;
                self.agreed(verdict)?
            }
            Work::Accept(verdict) => {
                work.accept(verdict)?;
                self.accepted()?
            }
            Work::CheckJoint(folds) => {
                work.check_joint(folds)?;
                self.checked()?
            }
            Work::CheckJointAll(folds) => {
                work.check_joint_all(folds)?;
                self.checked_all()?
            }
        }))
    }
}

/// Channel keys of a load job (relative to the load's prefix).
pub mod keys {
    /// Rank `rank`'s hello.
    pub fn hello(rank: u32) -> String {
        format!("hello/{rank}")
    }
    /// The coordinator's answer to rank `rank` (round 1).
    pub fn answer(rank: u32) -> String {
        format!("answer/{rank}")
    }
    /// Rank `rank`'s memory-tier verification.
    pub fn verified(rank: u32) -> String {
        format!("verified/{rank}")
    }
    /// The coordinator's plan answer to rank `rank` (after round 2).
    pub fn planned(rank: u32) -> String {
        format!("planned/{rank}")
    }
    /// Rank `rank`'s pair digests.
    pub fn pairs(rank: u32) -> String {
        format!("pairs/{rank}")
    }
    /// The coordinator's verdict on the plan.
    pub fn verdict() -> String {
        "verdict".to_string()
    }
    /// Rank `rank`'s folds of boxes read in parts.
    pub fn folds(rank: u32) -> String {
        format!("folds/{rank}")
    }
    /// The coordinator's word that every jointly read box checked.
    pub fn joint_checked() -> String {
        "joint".to_string()
    }
}
