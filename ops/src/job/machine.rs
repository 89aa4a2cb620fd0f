//! One rank's rounds of a load job (see the module doc of [`crate::job`]): states and
//! transitions only. What a round puts and fetches is decided here; the front end moves it, and
//! [`RankRounds::step`] has its local work done in between.

use bytes::Bytes;

use super::{Action, Event, PlannedRank, Round, Taken, Work, keys};
use crate::OpsError;

/// Where a rank is in its rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not started.
    Idle,
    /// Hello put; waiting for every rank's.
    Hello,
    /// The coordinator: fetching every hello.
    CollectHellos,
    /// Waiting for the coordinator's answer (round 1).
    AwaitAnswer,
    /// Verifying this rank's memory-tier share.
    Verifying,
    /// Verification put; waiting for every rank's.
    TierArrive,
    /// The coordinator: fetching every verification.
    CollectVerified,
    /// Waiting for the coordinator's plan answer (after round 2).
    AwaitPlanned,
    /// Pair digests put; waiting for every rank's.
    PlanArrive,
    /// The coordinator: fetching every rank's pair digests.
    CollectPairs,
    /// Waiting for the coordinator's verdict.
    AwaitVerdict,
    /// Reading this rank's pieces.
    Reading,
    /// Folds put; waiting for every rank's.
    ReadArrive,
    /// Fetching the folds of the readers this rank checks boxes with.
    GetFolds,
    /// The coordinator: fetching every rank's folds.
    CollectFolds,
    /// Waiting for the coordinator's word on the joint checks.
    AwaitJoint,
    /// Joint checks done; waiting for every rank's.
    JointArrive,
    /// Handed over to the exchange.
    Done,
}

/// What the machine wants next: actions for the front end's channel, or local work.
#[derive(Debug)]
pub(super) enum Next {
    /// Move these over the channel (or read), then call [`RankRounds::on`].
    Actions(Vec<Action>),
    /// Do this work, then report it with the matching method.
    Work(Work),
}

/// Rank `rank`'s rounds of a job of `world` ranks; rank 0 also coordinates. No I/O: see
/// [`RankRounds::step`] for the driver of its local work.
#[derive(Debug)]
pub struct RankRounds {
    rank: u32,
    world: u32,
    state: State,
    planned: Option<PlannedRank>,
}

impl RankRounds {
    /// Rank `rank` of `world`.
    pub fn new(rank: u32, world: u32) -> Self {
        Self {
            rank,
            world,
            state: State::Idle,
            planned: None,
        }
    }

    fn coordinates(&self) -> bool {
        self.rank == 0
    }

    /// The round the rank is in (for errors: "rank 3 failed {round.step()}").
    pub fn round(&self) -> Round {
        match self.state {
            State::Idle | State::Hello => Round::Requests,
            // The coordinator plans between the hellos and its answers; what fails there (the
            // plan, taking it) fails planning.
            State::CollectHellos | State::AwaitAnswer => Round::Plan,
            State::Verifying | State::TierArrive | State::CollectVerified => {
                Round::TierVerification
            }
            State::AwaitPlanned | State::PlanArrive | State::CollectPairs => Round::Plan,
            State::AwaitVerdict => Round::PlanAgreement,
            State::Reading | State::ReadArrive => Round::Read,
            State::GetFolds
            | State::CollectFolds
            | State::AwaitJoint
            | State::JointArrive
            | State::Done => Round::JointChecks,
        }
    }

    /// Round 1: put this rank's hello and arrive.
    pub fn start(&mut self, hello: Bytes) -> Vec<Action> {
        self.state = State::Hello;
        vec![
            Action::Put {
                key: keys::hello(self.rank),
                value: hello,
            },
            Action::Arrive {
                round: Round::Requests,
            },
        ]
    }

    fn every(&self, key: fn(u32) -> String) -> Vec<String> {
        (0..self.world).map(key).collect()
    }

    fn out_of_turn(&self, what: &str) -> OpsError {
        OpsError::invalid(format!(
            "rank {}: {what} in state {:?} of round {} ({}): the job's channel delivered out of turn",
            self.rank,
            self.state,
            self.round().number(),
            self.round().step()
        ))
    }

    /// Every value of a collective fetch, each present (rank order).
    fn all_present(&self, values: Vec<Option<Bytes>>, what: &str) -> Result<Vec<Bytes>, OpsError> {
        if values.len() != self.world as usize {
            return Err(self.out_of_turn(&format!(
                "{} {what} for {} ranks",
                values.len(),
                self.world
            )));
        }
        values
            .into_iter()
            .enumerate()
            .map(|(r, v)| {
                v.ok_or_else(|| {
                    OpsError::invalid(format!(
                        "rank {}: rank {r}'s {what} is missing after every rank arrived",
                        self.rank
                    ))
                })
            })
            .collect()
    }

    fn one(&self, mut values: Vec<Option<Bytes>>, what: &str) -> Result<Bytes, OpsError> {
        match (values.len(), values.pop()) {
            (1, Some(Some(value))) => Ok(value),
            _ => Err(self.out_of_turn(&format!("no {what}"))),
        }
    }

    /// The front end's `event` in the current state.
    pub(super) fn on(&mut self, event: Event) -> Result<Next, OpsError> {
        use State as S;
        let rank = self.rank;
        Ok(match (self.state, event) {
            (S::Hello, Event::Arrived) if self.coordinates() => {
                self.state = S::CollectHellos;
                Next::Actions(vec![Action::Get {
                    keys: self.every(keys::hello),
                    round: Round::Requests,
                }])
            }
            (S::Hello, Event::Arrived) => {
                self.state = S::AwaitAnswer;
                // The coordinator plans while the ranks wait for its answer.
                Next::Actions(vec![Action::Await {
                    key: keys::answer(rank),
                    round: Round::Plan,
                }])
            }
            (S::CollectHellos, Event::Got(values)) => {
                Next::Work(Work::Coordinate(self.all_present(values, "hello")?))
            }
            (S::AwaitAnswer, Event::Got(values)) => {
                Next::Work(Work::Take(self.one(values, "answer")?))
            }
            (S::TierArrive, Event::Arrived) if self.coordinates() => {
                self.state = S::CollectVerified;
                Next::Actions(vec![Action::Get {
                    keys: self.every(keys::verified),
                    round: Round::TierVerification,
                }])
            }
            (S::TierArrive, Event::Arrived) => {
                self.state = S::AwaitPlanned;
                Next::Actions(vec![Action::Await {
                    key: keys::planned(rank),
                    round: Round::Plan,
                }])
            }
            (S::CollectVerified, Event::Got(values)) => Next::Work(Work::Settle(
                self.all_present(values, "memory-tier verification")?,
            )),
            (S::AwaitPlanned, Event::Got(values)) => {
                Next::Work(Work::Take(self.one(values, "plan")?))
            }
            (S::PlanArrive, Event::Arrived) if self.coordinates() => {
                self.state = S::CollectPairs;
                Next::Actions(vec![Action::Get {
                    keys: self.every(keys::pairs),
                    round: Round::Plan,
                }])
            }
            (S::PlanArrive, Event::Arrived) => {
                self.state = S::AwaitVerdict;
                Next::Actions(vec![Action::Await {
                    key: keys::verdict(),
                    round: Round::PlanAgreement,
                }])
            }
            (S::CollectPairs, Event::Got(values)) => {
                Next::Work(Work::Agree(self.all_present(values, "plan digests")?))
            }
            (S::AwaitVerdict, Event::Got(values)) => {
                Next::Work(Work::Accept(self.one(values, "verdict")?))
            }
            (S::Reading, Event::Read(folds)) => {
                self.state = S::ReadArrive;
                let mut actions = Vec::with_capacity(2);
                if self.planned.as_ref().is_some_and(|p| p.shares_folds) {
                    actions.push(Action::Put {
                        key: keys::folds(rank),
                        value: folds,
                    });
                }
                actions.push(Action::Arrive { round: Round::Read });
                Next::Actions(actions)
            }
            (S::ReadArrive, Event::Arrived) => {
                let planned = self.planned.clone().unwrap_or_default();
                if planned.joint_at_coordinator && self.coordinates() {
                    self.state = S::CollectFolds;
                    Next::Actions(vec![Action::Get {
                        keys: self.every(keys::folds),
                        round: Round::JointChecks,
                    }])
                } else if planned.joint_at_coordinator {
                    self.state = S::AwaitJoint;
                    Next::Actions(vec![Action::Await {
                        key: keys::joint_checked(),
                        round: Round::JointChecks,
                    }])
                } else if planned.has_joint_checks {
                    self.state = S::GetFolds;
                    Next::Actions(vec![Action::Get {
                        keys: planned.fold_from.into_iter().map(keys::folds).collect(),
                        round: Round::JointChecks,
                    }])
                } else {
                    self.state = S::JointArrive;
                    Next::Actions(vec![Action::Arrive {
                        round: Round::JointChecks,
                    }])
                }
            }
            (S::CollectFolds, Event::Got(values)) => {
                if values.len() != self.world as usize {
                    return Err(self.out_of_turn("folds of every rank"));
                }
                Next::Work(Work::CheckJointAll(values))
            }
            (S::AwaitJoint, Event::Got(values)) => {
                self.one(values, "word on the joint checks")?;
                self.state = S::Done;
                Next::Actions(vec![Action::Exchange])
            }
            (S::GetFolds, Event::Got(values)) => {
                let from = self
                    .planned
                    .as_ref()
                    .map(|p| p.fold_from.clone())
                    .unwrap_or_default();
                if values.len() != from.len() {
                    return Err(self.out_of_turn("folds of other ranks"));
                }
                // A reader whose folds are missing is named by the check ("no fold from rank").
                let folds = from
                    .into_iter()
                    .zip(values)
                    .filter_map(|(peer, value)| value.map(|v| (peer, v)))
                    .collect();
                Next::Work(Work::CheckJoint(folds))
            }
            (S::JointArrive, Event::Arrived) => {
                self.state = S::Done;
                Next::Actions(vec![Action::Exchange])
            }
            (_, event) => return Err(self.out_of_turn(&format!("{event:?}"))),
        })
    }

    /// The coordinator's answers to every rank (after [`Work::Coordinate`] or
    /// [`Work::Settle`]): put under each rank's key; then it waits for its own, as every rank.
    pub(super) fn answered(&mut self, answers: Vec<Bytes>) -> Result<Next, OpsError> {
        let (key, round, next): (fn(u32) -> String, Round, State) = match self.state {
            State::CollectHellos => (keys::answer, Round::Plan, State::AwaitAnswer),
            State::CollectVerified => (keys::planned, Round::Plan, State::AwaitPlanned),
            _ => return Err(self.out_of_turn("answers")),
        };
        if answers.len() != self.world as usize {
            return Err(OpsError::invalid(format!(
                "rank {}: {} answers for a job of {} ranks",
                self.rank,
                answers.len(),
                self.world
            )));
        }
        self.state = next;
        let mut actions: Vec<Action> = answers
            .into_iter()
            .enumerate()
            .map(|(r, value)| Action::Put {
                key: key(r as u32),
                value,
            })
            .collect();
        actions.push(Action::Await {
            key: key(self.rank),
            round,
        });
        Ok(Next::Actions(actions))
    }

    /// This rank took its answer.
    pub(super) fn took(&mut self, taken: Taken) -> Result<Next, OpsError> {
        match (self.state, taken) {
            (State::AwaitAnswer, Taken::VerifyTier(node)) => {
                self.state = State::Verifying;
                Ok(Next::Work(Work::VerifyTier(node)))
            }
            (State::AwaitAnswer | State::AwaitPlanned, Taken::Planned(planned)) => {
                self.state = State::PlanArrive;
                let pairs = planned.pairs.clone();
                self.planned = Some(planned);
                Ok(Next::Actions(vec![
                    Action::Put {
                        key: keys::pairs(self.rank),
                        value: pairs,
                    },
                    Action::Arrive { round: Round::Plan },
                ]))
            }
            _ => Err(self.out_of_turn("an answer")),
        }
    }

    /// This rank verified its memory-tier share.
    pub(super) fn verified(&mut self, verified: Bytes) -> Result<Next, OpsError> {
        if self.state != State::Verifying {
            return Err(self.out_of_turn("a verification"));
        }
        self.state = State::TierArrive;
        Ok(Next::Actions(vec![
            Action::Put {
                key: keys::verified(self.rank),
                value: verified,
            },
            Action::Arrive {
                round: Round::TierVerification,
            },
        ]))
    }

    /// The coordinator's verdict: put for every rank, and taken by itself at once.
    pub(super) fn agreed(&mut self, verdict: Bytes) -> Result<Next, OpsError> {
        if self.state != State::CollectPairs {
            return Err(self.out_of_turn("a verdict"));
        }
        self.state = State::AwaitVerdict;
        Ok(Next::Actions(vec![
            Action::Put {
                key: keys::verdict(),
                value: verdict,
            },
            Action::Await {
                key: keys::verdict(),
                round: Round::PlanAgreement,
            },
        ]))
    }

    /// This rank accepted the verdict: it reads.
    pub(super) fn accepted(&mut self) -> Result<Next, OpsError> {
        if self.state != State::AwaitVerdict {
            return Err(self.out_of_turn("an accepted verdict"));
        }
        self.state = State::Reading;
        Ok(Next::Actions(vec![Action::Read]))
    }

    /// The coordinator checked every jointly read box: its word for every rank.
    pub(super) fn checked_all(&mut self) -> Result<Next, OpsError> {
        if self.state != State::CollectFolds {
            return Err(self.out_of_turn("the job's joint checks"));
        }
        self.state = State::AwaitJoint;
        Ok(Next::Actions(vec![
            Action::Put {
                key: keys::joint_checked(),
                value: Bytes::from_static(b"ok"),
            },
            Action::Await {
                key: keys::joint_checked(),
                round: Round::JointChecks,
            },
        ]))
    }

    /// This rank checked its jointly read boxes.
    pub(super) fn checked(&mut self) -> Result<Next, OpsError> {
        if self.state != State::GetFolds {
            return Err(self.out_of_turn("joint checks"));
        }
        self.state = State::JointArrive;
        Ok(Next::Actions(vec![Action::Arrive {
            round: Round::JointChecks,
        }]))
    }
}
