//! The `tessera` tool: storage locations, synthetic checkpoints, and the command implementations
//! behind the binary (layout, synth, plan, inspect, verify, demo). The planner and the checkpoint
//! model live in their own crates; this crate wires them to storage and to people.

pub mod commands;
pub mod exit;
pub mod human;
pub mod ranks;
