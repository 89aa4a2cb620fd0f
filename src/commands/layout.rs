//! `tessera layout <preset>`: print the layout JSON of a preset.

use anyhow::Result;
use tessera_planner::presets::{self, MegatronGpt};

/// Which preset.
#[derive(Clone, Debug)]
pub enum Preset {
    /// Everything `shard(0)` over dp.
    Fsdp {
        /// Data-parallel ranks.
        dp: u32,
    },
    /// Megatron-style TP/PP/DP.
    MegatronGpt(MegatronGpt),
}

/// The preset's layout as pretty JSON.
pub fn run(preset: &Preset) -> Result<String> {
    let layout = match preset {
        Preset::Fsdp { dp } => presets::fsdp(*dp)?,
        Preset::MegatronGpt(args) => presets::megatron_gpt(*args)?,
    };
    Ok(layout.to_json())
}
