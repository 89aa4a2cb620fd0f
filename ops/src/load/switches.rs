//! The loader's side-by-side switches, read once by the front ends. The library crates read no
//! environment; these variables exist for measurements (a benchmark run both ways) and as a
//! way back should a kernel or transport misbehave. Every one is on unless set to `0` (the
//! bounce buffer: unset, the machine's default).

use tessera_loader::load::LoadOptions;
use tessera_planner::PlanOptions;

/// The switches and the variable each is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSwitches {
    /// `TESSERA_POSITIONED_READS`: local checkpoints read by `pread` straight into the
    /// destinations ([`tessera_loader::read::ReadOptions::positioned_reads`]).
    pub positioned_reads: bool,
    /// `TESSERA_BOUNCE_READS`: misaligned local reads through a cache-resident bounce buffer
    /// ([`tessera_loader::read::ReadOptions::bounce_reads`]). Unset, the machine's default
    /// ([`tessera_loader::read::misaligned_copies_are_slow`]); `0` off, anything else on.
    pub bounce_reads: bool,
    /// `TESSERA_EXCHANGE_OVERLAP`: the exchange overlapped with the reads
    /// ([`LoadOptions::exchange_overlap`]).
    pub exchange_overlap: bool,
    /// `TESSERA_CROSS_MEMORY`: direct copies between ranks of one host
    /// ([`LoadOptions::cross_memory`]).
    pub cross_memory: bool,
    /// `TESSERA_JOINT_CHECKS`: column slices of a saved box verified jointly by its crc32c
    /// ([`PlanOptions::joint_checks`]). Every rank of a job must plan with the same value.
    pub joint_checks: bool,
}

impl Default for LoadSwitches {
    fn default() -> Self {
        LoadSwitches {
            positioned_reads: true,
            bounce_reads: tessera_loader::read::misaligned_copies_are_slow(),
            exchange_overlap: true,
            cross_memory: true,
            joint_checks: true,
        }
    }
}

impl LoadSwitches {
    /// The variables, in the order of the fields.
    pub const VARIABLES: [&'static str; 5] = [
        "TESSERA_POSITIONED_READS",
        "TESSERA_BOUNCE_READS",
        "TESSERA_EXCHANGE_OVERLAP",
        "TESSERA_CROSS_MEMORY",
        "TESSERA_JOINT_CHECKS",
    ];

    /// The switches from this process's environment.
    pub fn from_env() -> LoadSwitches {
        LoadSwitches::from_lookup(|name| std::env::var(name).ok())
    }

    /// The switches from `lookup` (a variable's value, `None` when unset): each is on unless
    /// its variable is `0`, but for the bounce buffer, which unset keeps the machine's default.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> LoadSwitches {
        let on = |name: &str| lookup(name).is_none_or(|v| v.trim() != "0");
        let [positioned, bounce, overlap, cross, joint] = LoadSwitches::VARIABLES;
        LoadSwitches {
            positioned_reads: on(positioned),
            bounce_reads: lookup(bounce).map_or(Self::default().bounce_reads, |v| v.trim() != "0"),
            exchange_overlap: on(overlap),
            cross_memory: on(cross),
            joint_checks: on(joint),
        }
    }

    /// Sets the load's options from these switches.
    pub fn apply_to_load(&self, options: &mut LoadOptions) {
        options.read.positioned_reads = self.positioned_reads;
        options.read.bounce_reads = self.bounce_reads;
        options.exchange_overlap = self.exchange_overlap;
        options.cross_memory = self.cross_memory;
    }

    /// Sets the plan's options from these switches.
    pub fn apply_to_plan(&self, options: &mut PlanOptions) {
        options.joint_checks = self.joint_checks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_switch_is_on_unless_its_variable_is_zero() {
        assert_eq!(LoadSwitches::from_lookup(|_| None), LoadSwitches::default());
        let off = LoadSwitches::from_lookup(|_| Some(" 0 ".to_string()));
        assert_eq!(
            off,
            LoadSwitches {
                positioned_reads: false,
                bounce_reads: false,
                exchange_overlap: false,
                cross_memory: false,
                joint_checks: false,
            }
        );
        let only_overlap_off = LoadSwitches::from_lookup(|name| {
            (name == "TESSERA_EXCHANGE_OVERLAP").then(|| "0".to_string())
        });
        assert!(!only_overlap_off.exchange_overlap);
        assert!(only_overlap_off.positioned_reads && only_overlap_off.cross_memory);
        let mut load = LoadOptions::default();
        let mut plan = PlanOptions::default();
        off.apply_to_load(&mut load);
        off.apply_to_plan(&mut plan);
        assert!(!load.read.positioned_reads && !load.read.bounce_reads);
        assert!(!load.exchange_overlap && !load.cross_memory && !plan.joint_checks);
        // Anything but 0 leaves a switch on; set, it turns the bounce buffer on on any CPU.
        let on = LoadSwitches::from_lookup(|_| Some("1".to_string()));
        assert!(on.joint_checks && on.bounce_reads);
    }
}
