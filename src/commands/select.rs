//! `--include` / `--exclude`: which tensors and plain (non-tensor) values `convert` and `load`
//! take, by glob over the tensor's name or the value's key (the layout rules' globs: `*` any run
//! of characters, dots included; `?` one character).

use anyhow::{Result, bail};
use tessera_metadata::{ObjectMeta, TensorMeta};
use tessera_planner::{RequestSet, glob_match};

/// The filter of a command: a tensor or plain value is taken when its name matches some
/// `include` pattern (or there are none) and no `exclude` pattern.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorFilter {
    /// Patterns a name must match one of (none: everything).
    pub include: Vec<String>,
    /// Patterns a name must match none of.
    pub exclude: Vec<String>,
}

/// What a filter takes of one checkpoint: one flag per tensor and per plain value, in the
/// metadata's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Per tensor of the checkpoint.
    pub tensors: Vec<bool>,
    /// Per plain value (object) of the checkpoint.
    pub objects: Vec<bool>,
}

impl TensorFilter {
    /// Whether the filter takes everything without looking.
    pub fn is_everything(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }

    fn takes(&self, name: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|p| glob_match(p, name)))
            && !self.exclude.iter().any(|p| glob_match(p, name))
    }

    /// Which of the `tensors` and plain values (`objects`) of the checkpoint at `location` the
    /// filter takes. Patterns cover both: `--exclude 'train_state.*'` drops a train state held
    /// as plain values as `--exclude 'optim.*'` drops optimizer tensors. A pattern that matches
    /// nothing at all is an error naming it (a typo would otherwise convert or load quietly less
    /// or more than meant), and so is a filter that leaves nothing.
    pub fn select(
        &self,
        tensors: &[TensorMeta],
        objects: &[ObjectMeta],
        location: &str,
    ) -> Result<Selection> {
        for (flag, patterns) in [("--include", &self.include), ("--exclude", &self.exclude)] {
            for pattern in patterns {
                let matches = tensors.iter().any(|t| glob_match(pattern, &t.fqn))
                    || objects.iter().any(|o| glob_match(pattern, &o.key));
                if !matches {
                    bail!(
                        "{flag} {pattern:?} matches no tensor of {location} and no plain value \
                         ({} tensors, {} plain values; `tessera inspect {location}` lists them)",
                        tensors.len(),
                        objects.len()
                    );
                }
            }
        }
        let selection = Selection {
            tensors: tensors.iter().map(|t| self.takes(&t.fqn)).collect(),
            objects: objects.iter().map(|o| self.takes(&o.key)).collect(),
        };
        if !selection.tensors.contains(&true) && !selection.objects.contains(&true) {
            bail!(
                "no tensor and no plain value of {location} is left by {}",
                self.describe().join(" ")
            );
        }
        Ok(selection)
    }

    /// Drops every request for a tensor the selection leaves out, for a command that reads
    /// tensors only (`load`, the safetensors export): a selection without a tensor is an error
    /// there. Requests keep their tensor indices (into the checkpoint's tensors), so a layout
    /// resolves against the whole checkpoint (its pipeline stages see every layer) and only then
    /// loses the tensors left out.
    pub fn apply(
        &self,
        requests: &mut RequestSet,
        tensors: &[TensorMeta],
        objects: &[ObjectMeta],
        location: &str,
    ) -> Result<()> {
        if self.is_everything() {
            return Ok(());
        }
        let selection = self.select(tensors, objects, location)?;
        if !selection.tensors.contains(&true) {
            bail!(
                "no tensor of {location} is left by {} (it leaves only plain values, and this \
                 command reads tensors)",
                self.describe().join(" ")
            );
        }
        selection.retain(requests);
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

impl Selection {
    /// Drops every request for a tensor left out (see [`TensorFilter::apply`]).
    pub fn retain(&self, requests: &mut RequestSet) {
        for rank in &mut requests.ranks {
            rank.retain(|r| {
                self.tensors
                    .get(r.tensor as usize)
                    .copied()
                    .unwrap_or(false)
            });
        }
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

    fn objects(keys: &[&str]) -> Vec<ObjectMeta> {
        keys.iter()
            .map(|k| ObjectMeta {
                key: k.to_string(),
                file: 0,
                offset: 0,
                length: 1,
                crc32c: None,
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
        let plain = objects(&["model.config", "train_state.step"]);
        let filter = TensorFilter {
            include: vec!["model.*".to_string()],
            exclude: vec!["*qkv*".to_string()],
        };
        let selection = filter.select(&all, &plain, "ckpt").unwrap();
        assert_eq!(selection.tensors, [true, false, false]);
        assert_eq!(selection.objects, [true, false]);
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
        filter.apply(&mut requests, &all, &plain, "ckpt").unwrap();
        assert_eq!(requests.ranks[0].len(), 1);
        assert_eq!(requests.ranks[0][0].tensor, 0);
    }

    /// `--exclude 'train_state.*'` where the train state is plain values only: it drops them
    /// and keeps every tensor (it failed "matches no tensor").
    #[test]
    fn a_pattern_matching_only_plain_values_selects_them() {
        let all = tensors(&["model.w", "model.b"]);
        let plain = objects(&["train_state.step", "train_state.lr", "note"]);
        let drop_state = TensorFilter {
            include: vec![],
            exclude: vec!["train_state.*".to_string()],
        };
        let selection = drop_state.select(&all, &plain, "ckpt").unwrap();
        assert_eq!(selection.tensors, [true, true]);
        assert_eq!(selection.objects, [false, false, true]);
        // Only plain values left: fine for a native conversion, refused where tensors are read.
        let only_state = TensorFilter {
            include: vec!["train_state.*".to_string()],
            exclude: vec![],
        };
        let selection = only_state.select(&all, &plain, "ckpt").unwrap();
        assert_eq!(selection.tensors, [false, false]);
        assert_eq!(selection.objects, [true, true, false]);
        let mut requests = RequestSet {
            ranks: vec![vec![]],
            disjoint: true,
        };
        let err = only_state
            .apply(&mut requests, &all, &plain, "ckpt")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("no tensor of ckpt is left by --include train_state.*"),
            "{err}"
        );
    }

    #[test]
    fn a_pattern_matching_nothing_is_named() {
        let all = tensors(&["model.embed.weight"]);
        let plain = objects(&["step"]);
        let filter = TensorFilter {
            include: vec!["model.*".to_string()],
            exclude: vec!["optim.*".to_string()],
        };
        let err = filter.select(&all, &plain, "ckpt").unwrap_err().to_string();
        assert_eq!(
            err,
            "--exclude \"optim.*\" matches no tensor of ckpt and no plain value (1 tensors, 1 \
             plain values; `tessera inspect ckpt` lists them)"
        );
        let everything_out = TensorFilter {
            include: vec![],
            exclude: vec!["*".to_string()],
        };
        let err = everything_out
            .select(&all, &plain, "ckpt")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "no tensor and no plain value of ckpt is left by --exclude *"
        );
    }
}
