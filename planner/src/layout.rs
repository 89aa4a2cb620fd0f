//! Layout JSON (DESIGN.md "Layout contract"): a device mesh plus per-tensor placement rules, and
//! its resolution into the box every rank needs of every tensor.

use regex::Regex;
use serde::{Deserialize, Serialize};
use tessera_metadata::{TensorBox, TensorMeta};

use crate::glob::glob_match;
use crate::{PlanError, Request, RequestSet, Target};

/// Most ranks a plan may have. A million ranks is beyond any job today; the bound is checked
/// before anything per rank is allocated, so that a typo (`"size": 1000000000`) gets an error
/// naming the mesh instead of a wrapped rank count or an allocation abort.
pub const MAX_WORLD: u32 = 1 << 20;

/// Most per-rank requests (ranks × tensors for a layout) a plan may hold: 2^27 requests take
/// about 12 GiB before planning proper starts, more than a planning host should give one plan.
pub const MAX_REQUESTS: u64 = 1 << 27;

/// A named mesh dimension.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshDim {
    /// Name, e.g. `pp`, `dp`, `tp`.
    pub name: String,
    /// Number of ranks along this dimension.
    pub size: u32,
}

/// One placement rule: the first rule whose glob matches a tensor's FQN decides its placements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// Glob over the FQN (`*` and `?`).
    #[serde(rename = "match")]
    pub pattern: String,
    /// One placement per mesh dim: `shard(d)`, `replicate` or `stage(layer)`.
    pub placements: Vec<String>,
}

/// How pipeline stages are derived from FQNs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stages {
    /// Regular expression whose first capture group is the layer number.
    #[serde(default = "default_layer_pattern")]
    pub layer_pattern: String,
    /// Number of layers; derived from the tensors (max layer + 1) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_layers: Option<u64>,
    /// Globs of tensors outside the layers that live on the first stage.
    #[serde(default)]
    pub first: Vec<String>,
    /// Globs of tensors outside the layers that live on the last stage.
    #[serde(default)]
    pub last: Vec<String>,
}

fn default_layer_pattern() -> String {
    r"layers\.(\d+)\.".to_string()
}

/// A target (or source) parallel layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Ordered mesh dims; ranks are numbered row-major (last dim fastest), like a torch DeviceMesh.
    pub mesh: Vec<MeshDim>,
    /// Rules, tried in order.
    pub rules: Vec<Rule>,
    /// Pipeline stage derivation, needed when any rule uses `stage(...)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Stages>,
}

/// A parsed placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Split tensor dim `d` like `torch.chunk`.
    Shard(usize),
    /// Every rank along the mesh dim holds the same box.
    Replicate,
    /// Only the ranks whose coordinate is the tensor's pipeline stage hold it.
    Stage,
}

impl Placement {
    /// Parses `shard(d)`, `replicate`, `stage(layer)`.
    pub fn parse(text: &str) -> Option<Placement> {
        let t = text.trim();
        if t == "replicate" {
            return Some(Placement::Replicate);
        }
        if t == "stage(layer)" {
            return Some(Placement::Stage);
        }
        let inner = t.strip_prefix("shard(")?.strip_suffix(')')?;
        inner.trim().parse().ok().map(Placement::Shard)
    }
}

impl Layout {
    /// Parses layout JSON.
    pub fn from_json(text: &str) -> Result<Layout, PlanError> {
        serde_json::from_str(text).map_err(|e| PlanError::Json {
            what: "layout",
            detail: e.to_string(),
        })
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Number of ranks: the product of the mesh sizes. Saturates at `u32::MAX` instead of
    /// wrapping; [`Layout::check`] (and so [`Layout::resolve`]) refuses a mesh over
    /// [`MAX_WORLD`], see [`Layout::checked_world_size`].
    pub fn world_size(&self) -> u32 {
        self.mesh
            .iter()
            .fold(1u32, |acc, d| acc.saturating_mul(d.size))
    }

    /// Number of ranks, or [`PlanError::WorldTooLarge`] naming the mesh when the product of the
    /// mesh sizes is over [`MAX_WORLD`] (computed in `u128`, so it never wraps).
    pub fn checked_world_size(&self) -> Result<u32, PlanError> {
        let ranks = self
            .mesh
            .iter()
            .fold(1u128, |acc, d| acc.saturating_mul(u128::from(d.size)));
        match u32::try_from(ranks) {
            Ok(world) if world <= MAX_WORLD => Ok(world),
            _ => Err(PlanError::WorldTooLarge {
                field: self.mesh_field(),
                ranks,
                limit: MAX_WORLD,
            }),
        }
    }

    /// `layout mesh [pp=2, dp=4]`: how errors name the mesh.
    fn mesh_field(&self) -> String {
        let dims: Vec<String> = self
            .mesh
            .iter()
            .map(|d| format!("{}={}", d.name, d.size))
            .collect();
        format!("layout mesh [{}]", dims.join(", "))
    }

    /// Mesh coordinates of `rank` (row-major, last dim fastest).
    pub fn coords(&self, rank: u32) -> Vec<u32> {
        let mut coords = vec![0; self.mesh.len()];
        let mut rest = rank;
        for (i, dim) in self.mesh.iter().enumerate().rev() {
            coords[i] = rest % dim.size;
            rest /= dim.size;
        }
        coords
    }

    /// Checks the mesh and the rules' placements (not yet against tensors).
    pub fn check(&self) -> Result<Vec<Vec<Placement>>, PlanError> {
        for (i, dim) in self.mesh.iter().enumerate() {
            if dim.size == 0 {
                return Err(PlanError::MeshSizeZero {
                    name: dim.name.clone(),
                });
            }
            if self.mesh[..i].iter().any(|d| d.name == dim.name) {
                return Err(PlanError::DuplicateMeshDim {
                    name: dim.name.clone(),
                });
            }
        }
        self.checked_world_size()?;
        let mut parsed = Vec::with_capacity(self.rules.len());
        for (r, rule) in self.rules.iter().enumerate() {
            if rule.placements.len() != self.mesh.len() {
                return Err(PlanError::PlacementCount {
                    rule: r,
                    pattern: rule.pattern.clone(),
                    expected: self.mesh.len(),
                    got: rule.placements.len(),
                });
            }
            let mut placements = Vec::with_capacity(rule.placements.len());
            for text in &rule.placements {
                let Some(p) = Placement::parse(text) else {
                    return Err(PlanError::UnknownPlacement {
                        rule: r,
                        pattern: rule.pattern.clone(),
                        placement: text.clone(),
                    });
                };
                placements.push(p);
            }
            if placements
                .iter()
                .filter(|p| **p == Placement::Stage)
                .count()
                > 1
            {
                return Err(PlanError::MultipleStages {
                    rule: r,
                    pattern: rule.pattern.clone(),
                });
            }
            parsed.push(placements);
        }
        Ok(parsed)
    }

    /// What in the layout does not fit `tensors` though it resolves: pipeline stages made for
    /// another number of layers than the checkpoint has (a `megatron-gpt --num-layers 12` layout
    /// against a 4-layer checkpoint puts every layer on the first stages and leaves the others
    /// only the first/last tensors), or a layer pattern no tensor matches. Each warning is a
    /// sentence naming the field and the numbers; empty when everything fits.
    pub fn warnings(&self, tensors: &[TensorMeta]) -> Vec<String> {
        let mut out = Vec::new();
        let Some(stages) = &self.stages else {
            return out;
        };
        // An invalid pattern is an error of `resolve`; nothing to warn about here.
        let Ok(pattern) = Regex::new(&stages.layer_pattern) else {
            return out;
        };
        let max_layer = tensors
            .iter()
            .filter_map(|t| layer_number(&pattern, &t.fqn))
            .max();
        let uses_stages = self.rules.iter().any(|rule| {
            rule.placements
                .iter()
                .any(|p| Placement::parse(p) == Some(Placement::Stage))
        });
        if !uses_stages {
            return out;
        }
        match (max_layer, stages.num_layers) {
            (None, _) => out.push(format!(
                "no tensor of the checkpoint matches the layout's stages.layer_pattern {:?}: \
                 every tensor goes by stages.first/last, so the pipeline stages between hold \
                 nothing",
                stages.layer_pattern
            )),
            (Some(max), Some(num_layers)) if max + 1 < num_layers => {
                let stage_count = self.stage_count();
                let used = stage_count.map(|p| {
                    // The stage of the checkpoint's last layer: the stages after it get no layer.
                    let p = u128::from(p);
                    ((u128::from(max) + 1) * p - 1) / u128::from(num_layers) + 1
                });
                out.push(format!(
                    "the layout's stages.num_layers is {num_layers} but the checkpoint has {} \
                     layers (0..{max}){}; make the layout for {} layers (e.g. `tessera layout \
                     megatron-gpt --num-layers {}`)",
                    max + 1,
                    match (used, stage_count) {
                        (Some(1), Some(p)) if p > 1 => format!(
                            ": they all go to pipeline stage 0 of {p}, the others hold no layer"
                        ),
                        (Some(used), Some(p)) if used < u128::from(p) => format!(
                            ": they all go to the first {used} of {p} pipeline stages, the \
                             others hold no layer"
                        ),
                        _ => ": the pipeline stages are unbalanced".to_string(),
                    },
                    max + 1,
                    max + 1,
                ));
            }
            _ => {}
        }
        out
    }

    /// The size of the mesh dim a `stage(layer)` placement is on (the pipeline stages), when
    /// the rules agree on one.
    fn stage_count(&self) -> Option<u32> {
        let mut sizes = self.rules.iter().flat_map(|rule| {
            rule.placements
                .iter()
                .zip(&self.mesh)
                .filter(|(p, _)| Placement::parse(p) == Some(Placement::Stage))
                .map(|(_, dim)| dim.size)
        });
        let first = sizes.next()?;
        sizes.all(|s| s == first).then_some(first)
    }

    /// The box every rank needs of every tensor: rank `r`'s requests are `result.ranks[r]`.
    /// A rank whose shard of a tensor is empty still gets an (empty) request, as DTensor does.
    pub fn resolve(&self, tensors: &[TensorMeta]) -> Result<RequestSet, PlanError> {
        let placements = self.check()?;
        let world = self.checked_world_size()?;
        // One request per rank and tensor (empty shards included): bound it before allocating.
        let tensors_len = tensors.len() as u64;
        let requests = u64::from(world).saturating_mul(tensors_len);
        if requests > MAX_REQUESTS {
            let bytes = u128::from(requests) * std::mem::size_of::<Request>() as u128;
            return Err(PlanError::TooManyRequests {
                field: self.mesh_field(),
                ranks: world,
                tensors: tensors_len,
                requests,
                limit: MAX_REQUESTS,
                gib: u64::try_from(bytes >> 30).unwrap_or(u64::MAX),
            });
        }
        let stage_of = StageResolver::new(self, tensors)?;
        let coords: Vec<Vec<u32>> = (0..world).map(|r| self.coords(r)).collect();
        let mut ranks: Vec<Vec<Request>> = vec![Vec::new(); world as usize];
        for (t, tensor) in tensors.iter().enumerate() {
            let rule_placements = self.placements_of(tensor, &placements)?;
            // 0-dim tensors are always replicated: there is nothing to split and no stage to own.
            if tensor.shape.is_empty() {
                for requests in &mut ranks {
                    requests.push(Request {
                        tensor: t as u32,
                        target: Target::Box(TensorBox::whole(&[])),
                    });
                }
                continue;
            }
            let stage_dim = rule_placements.iter().position(|p| *p == Placement::Stage);
            let stage = if rule_placements.contains(&Placement::Stage) {
                Some(stage_of.stage(tensor, self.stage_dim_size(rule_placements))?)
            } else {
                None
            };
            // Only the ranks on the tensor's stage hold it: with the stage on mesh dim i they are
            // blocks of stride(i) consecutive ranks, one every stride(i)·size(i).
            let (block, period, first) = match (stage_dim, stage) {
                (Some(i), Some(s)) => {
                    let stride: u32 = self.mesh[i + 1..].iter().map(|d| d.size).product();
                    (stride, stride * self.mesh[i].size, s * stride)
                }
                _ => (world, world, 0),
            };
            let mut start = first;
            while start < world {
                for rank in start..start + block {
                    if let Some(region) = shard_box(
                        &tensor.shape,
                        rule_placements,
                        &self.mesh,
                        &coords[rank as usize],
                        stage,
                    ) {
                        ranks[rank as usize].push(Request {
                            tensor: t as u32,
                            target: Target::Box(region),
                        });
                    }
                }
                start += period;
            }
        }
        Ok(RequestSet {
            ranks,
            disjoint: true,
        })
    }

    /// The placements of the first rule matching `tensor` (`placements` from [`Layout::check`]),
    /// checked against its dims; none for a 0-dim tensor, which is always replicated. The one
    /// place resolving and estimating a layout match rules, so both refuse the same tensors.
    pub(crate) fn placements_of<'a>(
        &self,
        tensor: &TensorMeta,
        placements: &'a [Vec<Placement>],
    ) -> Result<&'a [Placement], PlanError> {
        let Some(rule) = self
            .rules
            .iter()
            .position(|rule| glob_match(&rule.pattern, &tensor.fqn))
        else {
            return Err(PlanError::NoMatchingRule {
                fqn: tensor.fqn.clone(),
            });
        };
        let ndim = tensor.shape.len();
        if ndim == 0 {
            return Ok(&[]);
        }
        for p in &placements[rule] {
            if let Placement::Shard(dim) = *p
                && dim >= ndim
            {
                return Err(PlanError::ShardDimOutOfRange {
                    fqn: tensor.fqn.clone(),
                    rule,
                    pattern: self.rules[rule].pattern.clone(),
                    dim,
                    ndim,
                });
            }
        }
        Ok(&placements[rule])
    }

    pub(crate) fn stage_dim_size(&self, placements: &[Placement]) -> u32 {
        placements
            .iter()
            .position(|p| *p == Placement::Stage)
            .map_or(1, |i| self.mesh[i].size)
    }
}

/// The box a rank at `coords` holds, or `None` when a stage placement excludes it. Shards over
/// several mesh dims of one tensor dim nest in mesh order, each splitting the previous shard like
/// `torch.chunk`: chunk = ceil(n / k), part i = [i·chunk, min((i+1)·chunk, n)), possibly empty.
pub fn shard_box(
    shape: &[u64],
    placements: &[Placement],
    mesh: &[MeshDim],
    coords: &[u32],
    stage: Option<u32>,
) -> Option<TensorBox> {
    // Stage exclusion first: most ranks of a pipeline hold most tensors not at all.
    let excluded = placements
        .iter()
        .zip(coords)
        .any(|(p, &c)| *p == Placement::Stage && Some(c) != stage);
    if excluded {
        return None;
    }
    let mut region = TensorBox::whole(shape);
    for (i, p) in placements.iter().enumerate() {
        match *p {
            Placement::Replicate | Placement::Stage => {}
            Placement::Shard(dim) => {
                // In u128: (c + 1) · ceil(n / k) may pass u64::MAX for n near it.
                let n = u128::from(region.lengths[dim]);
                let k = u128::from(mesh[i].size);
                let chunk = n.div_ceil(k);
                let c = u128::from(coords[i]);
                let start = (c * chunk).min(n);
                let end = ((c + 1) * chunk).min(n);
                // Both are at most n, which came from a u64.
                let (start, end) = (start as u64, end as u64);
                region.offsets[dim] += start;
                region.lengths[dim] = end - start;
            }
        }
    }
    Some(region)
}

/// Derives pipeline stages: the layer number from the FQN balanced over `num_layers`, or the
/// first/last stage for tensors outside the layers.
pub(crate) struct StageResolver {
    pattern: Option<Regex>,
    num_layers: Option<u64>,
    first: Vec<String>,
    last: Vec<String>,
}

impl StageResolver {
    pub(crate) fn new(layout: &Layout, tensors: &[TensorMeta]) -> Result<Self, PlanError> {
        let Some(stages) = &layout.stages else {
            return Ok(Self {
                pattern: None,
                num_layers: None,
                first: Vec::new(),
                last: Vec::new(),
            });
        };
        let pattern =
            Regex::new(&stages.layer_pattern).map_err(|e| PlanError::InvalidLayerPattern {
                pattern: stages.layer_pattern.clone(),
                detail: e.to_string(),
            })?;
        if pattern.captures_len() < 2 {
            return Err(PlanError::InvalidLayerPattern {
                pattern: stages.layer_pattern.clone(),
                detail: "it needs a capture group for the layer number".to_string(),
            });
        }
        let num_layers = match stages.num_layers {
            Some(n) => Some(n),
            None => tensors
                .iter()
                .filter_map(|t| layer_number(&pattern, &t.fqn))
                .max()
                .map(|max| max + 1),
        };
        Ok(Self {
            pattern: Some(pattern),
            num_layers,
            first: stages.first.clone(),
            last: stages.last.clone(),
        })
    }

    /// The stage of `tensor` among `stages` pipeline stages.
    pub(crate) fn stage(&self, tensor: &TensorMeta, stages: u32) -> Result<u32, PlanError> {
        let fail = |reason: String| PlanError::StageUnderivable {
            fqn: tensor.fqn.clone(),
            reason,
        };
        let Some(pattern) = &self.pattern else {
            return Err(fail(
                "the layout has a stage(layer) placement but no \"stages\" section".to_string(),
            ));
        };
        if let Some(layer) = layer_number(pattern, &tensor.fqn) {
            let num_layers = self.num_layers.unwrap_or(layer + 1);
            if layer >= num_layers {
                return Err(fail(format!("layer {layer} >= num_layers {num_layers}")));
            }
            // Balanced split: stage s holds layers [floor(s·L/P), floor((s+1)·L/P)). In u128:
            // a layer number from the FQN times the stage count may not fit u64.
            let p = u128::from(stages);
            let stage = ((u128::from(layer) + 1) * p - 1) / u128::from(num_layers);
            // layer < num_layers, so stage < p <= u32::MAX.
            return Ok(u32::try_from(stage).unwrap_or(stages.saturating_sub(1)));
        }
        if self.first.iter().any(|g| glob_match(g, &tensor.fqn)) {
            return Ok(0);
        }
        if self.last.iter().any(|g| glob_match(g, &tensor.fqn)) {
            return Ok(stages - 1);
        }
        Err(fail(format!(
            "no layer number matches {:?} and it matches neither first {:?} nor last {:?}",
            pattern.as_str(),
            self.first,
            self.last
        )))
    }
}

fn layer_number(pattern: &Regex, fqn: &str) -> Option<u64> {
    pattern.captures(fqn)?.get(1)?.as_str().parse().ok()
}
