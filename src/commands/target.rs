//! The target of `tessera plan` and `tessera load`: `--layout FILE` or `--requests FILE`,
//! resolved against the checkpoint's tensors into every rank's requests.

use anyhow::{Context, Result, bail};
use tessera_metadata::CheckpointMeta;
use tessera_planner::{ExplicitRequests, PlanEstimate, PlanOptions, RequestSet};

/// The most memory planning may take by the planner's estimate (`--plan-memory-mib`), for plans
/// with `options`.
pub struct PlanBound<'a> {
    /// The plan's options (dedup changes what planning holds).
    pub options: &'a PlanOptions,
    /// Bytes.
    pub bytes: u64,
}

/// Every rank's requests for the target `--layout` or `--requests` names (exactly one of them),
/// resolved against `meta` of the checkpoint at `location`. With `bound`, a target whose plan
/// the planner estimates over it is refused before the costly part: a layout before it is
/// resolved (resolving alone allocates a request per rank and tensor), explicit requests after
/// (they are as many as the file lists, so resolving them costs what reading the file did).
/// A layout's warnings are printed when `warn` (once per job: every rank of a real job
/// resolves the same layout).
pub fn resolve(
    location: &str,
    (layout, requests): (Option<&str>, Option<&str>),
    meta: &CheckpointMeta,
    bound: Option<PlanBound<'_>>,
    warn: bool,
) -> Result<RequestSet> {
    let check = |estimate: PlanEstimate, what: &str| match &bound {
        Some(bound) => within_bound(estimate, bound.bytes, &format!("{location} for {what}")),
        None => Ok(()),
    };
    match (layout, requests) {
        (Some(path), None) => {
            let layout = super::read_layout(path)?;
            let resolving = || format!("resolving layout {path} against {location}");
            if let Some(bound) = &bound {
                let estimate = layout
                    .estimate(meta, bound.options)
                    .with_context(resolving)?;
                check(estimate, &format!("layout {path}"))?;
            }
            let requests = layout.resolve(meta.tensors()).with_context(resolving)?;
            if warn {
                super::warn_layout(path, &layout, meta.tensors());
            }
            Ok(requests)
        }
        (None, Some(path)) => {
            let requests = ExplicitRequests::from_json(&super::read_text(path)?)
                .and_then(|r| r.resolve(meta.tensors()))
                .with_context(|| format!("reading requests {path}"))?;
            if let Some(bound) = &bound {
                check(
                    requests.estimate(meta, bound.options),
                    &format!("requests {path}"),
                )?;
            }
            Ok(requests)
        }
        _ => bail!("give exactly one of --layout or --requests"),
    }
}

/// Refuses to plan `what` when the planner's estimate is over `limit` bytes: the server's check
/// and bound (`PlanEstimate::within`, `--plan-memory-mib`), so that a typo'd mesh fails at once
/// naming its estimate instead of aborting on allocation tens of GB later.
fn within_bound(estimate: PlanEstimate, limit: u64, what: &str) -> Result<()> {
    estimate.within(limit).with_context(|| {
        format!("refusing to plan {what} (raise the bound with --plan-memory-mib if this machine has the memory)")
    })?;
    Ok(())
}
