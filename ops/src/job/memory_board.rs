//! The job's rounds run for every rank of a job in one process, over an in-memory board that
//! counts what each rank puts and reads: the tests' channel, and the scale simulation's
//! (`benches/job_scale.rs`). The ranks take turns; a rank waits where the real channel would make
//! it wait (an arrival until every rank arrived, an awaited key until it is written), so the
//! order of events is one a real job can produce.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::{Action, Event, JobWork, RankRounds, Round};
use crate::OpsError;

/// What one rank moved over the board.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Values put, and their bytes.
    pub puts: u64,
    /// Bytes put.
    pub bytes_put: u64,
    /// Values fetched (present or not), and their bytes.
    pub reads: u64,
    /// Bytes fetched.
    pub bytes_read: u64,
    /// Arrivals.
    pub arrivals: u64,
}

/// Why a simulated job stopped.
#[derive(Debug)]
pub struct JobFailure {
    /// The rank that failed.
    pub rank: u32,
    /// The round it was in.
    pub round: Round,
    /// Its error.
    pub error: Box<OpsError>,
}

impl std::fmt::Display for JobFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} failed {}: {}",
            self.rank,
            self.round.step(),
            self.error
        )
    }
}

impl JobFailure {
    /// The failure as rank `me` raises it: its own error as it is (and a rank that died as its
    /// own transport names it), another rank's as [`OpsError::RankFailed`].
    pub fn on_rank(self, me: u32) -> OpsError {
        let died = matches!(&*self.error, OpsError::Loader(e)
            if matches!(**e, tessera_loader::LoaderError::Transport { .. }));
        if self.rank == me || died {
            return *self.error;
        }
        OpsError::RankFailed {
            rank: self.rank,
            step: self.round.step(),
            detail: self.error.to_string(),
        }
    }
}

// The failing rank's error is in the text already: no source, so that a chain does not say it twice.
impl std::error::Error for JobFailure {}

/// A rank's turn: its rounds, the actions it has yet to move, and what it waits on.
struct Turn {
    rounds: RankRounds,
    queue: VecDeque<Action>,
    waiting: Option<Action>,
    exchanged: bool,
}

/// Runs the rounds of `works.len()` ranks (rank r says `hellos[r]` and does its local work with
/// `works[r]`; `read(r)` is rank r's read, its folds) until every rank reaches the exchange.
/// Returns what each rank moved over the board, or the first rank's failure.
pub fn run_rounds<W: JobWork>(
    works: &mut [W],
    hellos: Vec<Bytes>,
    mut read: impl FnMut(u32) -> Bytes,
) -> Result<Vec<Traffic>, JobFailure> {
    let world = works.len() as u32;
    let mut board: HashMap<String, Bytes> = HashMap::new();
    let mut arrived: HashMap<Round, u32> = HashMap::new();
    let mut traffic = vec![Traffic::default(); works.len()];
    let mut turns: Vec<Turn> = hellos
        .into_iter()
        .enumerate()
        .map(|(r, hello)| {
            let mut rounds = RankRounds::new(r as u32, world);
            let queue = rounds.start(hello).into();
            Turn {
                rounds,
                queue,
                waiting: None,
                exchanged: false,
            }
        })
        .collect();
    loop {
        let mut moved = false;
        for (r, turn) in turns.iter_mut().enumerate() {
            let rank = r as u32;
            let fail = |turn: &Turn, error: OpsError| JobFailure {
                rank,
                round: turn.rounds.round(),
                error: Box::new(error),
            };
            loop {
                // What the rank waits on, if it can go on now, and the event that lets it.
                let event = match turn.waiting.take() {
                    Some(Action::Arrive { round }) => {
                        if arrived.get(&round).copied().unwrap_or(0) < world {
                            turn.waiting = Some(Action::Arrive { round });
                            break;
                        }
                        Some(Event::Arrived)
                    }
                    Some(Action::Await { key, round }) => match board.get(&key) {
                        Some(value) => {
                            let t = &mut traffic[r];
                            t.reads += 1;
                            t.bytes_read += value.len() as u64;
                            Some(Event::Got(vec![Some(value.clone())]))
                        }
                        None => {
                            turn.waiting = Some(Action::Await { key, round });
                            break;
                        }
                    },
                    Some(other) => {
                        turn.waiting = Some(other);
                        break;
                    }
                    None => None,
                };
                let event = match event {
                    Some(event) => event,
                    None => match turn.queue.pop_front() {
                        None => break,
                        Some(Action::Put { key, value }) => {
                            let t = &mut traffic[r];
                            t.puts += 1;
                            t.bytes_put += value.len() as u64;
                            board.insert(key, value);
                            moved = true;
                            continue;
                        }
                        Some(Action::Arrive { round }) => {
                            traffic[r].arrivals += 1;
                            *arrived.entry(round).or_default() += 1;
                            turn.waiting = Some(Action::Arrive { round });
                            moved = true;
                            continue;
                        }
                        Some(waiting @ Action::Await { .. }) => {
                            turn.waiting = Some(waiting);
                            continue;
                        }
                        Some(Action::Get { keys, .. }) => {
                            let t = &mut traffic[r];
                            let values: Vec<Option<Bytes>> = keys
                                .iter()
                                .map(|k| {
                                    let v = board.get(k).cloned();
                                    t.reads += 1;
                                    t.bytes_read += v.as_ref().map_or(0, |v| v.len() as u64);
                                    v
                                })
                                .collect();
                            Event::Got(values)
                        }
                        Some(Action::Read) => Event::Read(read(rank)),
                        Some(Action::Exchange) => {
                            turn.exchanged = true;
                            moved = true;
                            break;
                        }
                    },
                };
                moved = true;
                let actions = turn
                    .rounds
                    .step(&mut works[r], event)
                    .map_err(|e| fail(turn, e))?;
                turn.queue.extend(actions);
            }
        }
        if turns.iter().all(|t| t.exchanged) {
            return Ok(traffic);
        }
        if !moved {
            let stuck = turns.iter().position(|t| !t.exchanged).unwrap_or(0);
            let turn = &turns[stuck];
            return Err(JobFailure {
                rank: stuck as u32,
                round: turn.rounds.round(),
                error: Box::new(OpsError::invalid(format!(
                    "the job's rounds stopped: rank {stuck} waits on {:?} and no rank can move",
                    turn.waiting
                ))),
            });
        }
    }
}
