//! `--include` / `--exclude`: which tensors `convert` and `load` take, by glob over the tensor's
//! name (the layout rules' globs: `*` any run of characters, dots included; `?` one character).

use anyhow::{Result, bail};
use tessera_metadata::TensorMeta;
use tessera_planner::{RequestSet, glob_match};

/// The tensor filter of a command: a tensor is taken when it matches some `include` pattern (or
/// there are none) and no `exclude` pattern.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorFilter {
    /// Patterns a tensor must match one of (none: every tensor).
    pub include: Vec<String>,
    /// Patterns a tensor must match none of.
    pub exclude: Vec<String>,
}

impl TensorFilter {
    /// Whether the filter takes every tensor without looking.
    pub fn is_everything(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }

    /// Which of `tensors` (of the checkpoint at `location`) the filter takes. A pattern that
    /// matches no tensor at all is an error naming it (a typo would otherwise load or export
    /// quietly less or more than meant), and so is a filter that leaves nothing.
    pub fn select(&self, tensors: &[TensorMeta], location: &str) -> Result<Vec<bool>> {
        for (flag, patterns) in [("--include", &self.include), ("--exclude", &self.exclude)] {
            for pattern in patterns {
                if !tensors.iter().any(|t| glob_match(pattern, &t.fqn)) {
                    bail!(
                        "{flag} {pattern:?} matches no tensor of {location} ({} tensors; \
                         `tessera inspect {location}` lists them)",
                        tensors.len()
                    );
                }
            }
        }
        let taken: Vec<bool> = tensors
            .iter()
            .map(|t| {
                (self.include.is_empty() || self.include.iter().any(|p| glob_match(p, &t.fqn)))
                    && !self.exclude.iter().any(|p| glob_match(p, &t.fqn))
            })
            .collect();
        if !taken.contains(&true) {
            bail!(
                "no tensor of {location} is left by {}",
                self.describe().join(" ")
            );
        }
        Ok(taken)
    }

    /// Drops every request for a tensor the filter does not take. Requests keep their tensor
    /// indices (into the checkpoint's tensors), so a layout resolves against the whole
    /// checkpoint (its pipeline stages see every layer) and only then loses the tensors left out.
    pub fn apply(
        &self,
        requests: &mut RequestSet,
        tensors: &[TensorMeta],
        location: &str,
    ) -> Result<()> {
        if self.is_everything() {
            return Ok(());
        }
        let taken = self.select(tensors, location)?;
        for rank in &mut requests.ranks {
            rank.retain(|r| taken.get(r.tensor as usize).copied().unwrap_or(false));
        }
        Ok(())
    }

    /// The filter as command-line arguments (for the rank processes a load starts).
    pub fn describe(&self) -> Vec<String> {
        let mut args = Vec::new();
        for pattern in &self.include {
            args.push("--include".to_string());
            args.push(pattern.clone());
        }
        for pattern in &self.exclude {
            args.push("--exclude".to_string());
            args.push(pattern.clone());
        }
        args
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tessera_metadata::DType;
    use tessera_metadata::TensorBox;
    use tessera_planner::{Request, Target};

    fn tensors(names: &[&str]) -> Vec<TensorMeta> {
        names
            .iter()
            .map(|n| TensorMeta {
                fqn: n.to_string(),
                dtype: DType::F32,
                shape: vec![4],
            })
            .collect()
    }

    #[test]
    fn include_then_exclude() {
        let all = tensors(&[
            "model.embed.weight",
            "model.layers.0.attn.qkv.weight",
            "optim.state.model.embed.weight.exp_avg",
        ]);
        let filter = TensorFilter {
            include: vec!["model.*".to_string()],
            exclude: vec!["*qkv*".to_string()],
        };
        assert_eq!(filter.select(&all, "ckpt").unwrap(), [true, false, false]);
        let mut requests = RequestSet {
            ranks: vec![
                (0..3)
                    .map(|t| Request {
                        tensor: t,
                        target: Target::Box(TensorBox::whole(&[4])),
                    })
                    .collect(),
            ],
            disjoint: true,
        };
        filter.apply(&mut requests, &all, "ckpt").unwrap();
        assert_eq!(requests.ranks[0].len(), 1);
        assert_eq!(requests.ranks[0][0].tensor, 0);
    }

    #[test]
    fn a_pattern_matching_nothing_is_named() {
        let all = tensors(&["model.embed.weight"]);
        let filter = TensorFilter {
            include: vec!["model.*".to_string()],
            exclude: vec!["optim.*".to_string()],
        };
        let err = filter.select(&all, "ckpt").unwrap_err().to_string();
        assert!(
            err.contains("--exclude \"optim.*\" matches no tensor of ckpt"),
            "{err}"
        );
        let everything_out = TensorFilter {
            include: vec![],
            exclude: vec!["*".to_string()],
        };
        let err = everything_out.select(&all, "ckpt").unwrap_err().to_string();
        assert!(
            err.contains("no tensor of ckpt is left by --exclude *"),
            "{err}"
        );
    }
}
