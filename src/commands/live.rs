//! `tessera live list|show --registry DIR`: the live publications (`tessera.publish`) of a
//! registry directory, as `tessera serve --registry DIR` lists them (`/v1/live`): each one's
//! newest complete step (what `live://NAME` loads), its publisher ranks and bytes, and its
//! newest steps with their state (complete; incomplete naming the ranks whose parts are missing;
//! retired), servers and times. The listing is `tessera_ops::publish::listing`'s; this renders
//! it as text or JSON.

use std::fmt::Write;
use std::path::Path;

use anyhow::Result;
use tessera_ops::publish::listing::{
    self, ListOptions, PublicationEntry, RegistryListing, StepEntry, StepState,
};

use crate::human;

/// The listing of every publication in `registry`, `steps` steps each.
pub fn list(registry: &Path, steps: usize) -> Result<RegistryListing> {
    Ok(listing::list_registry(registry, &ListOptions { steps })?)
}

/// The publication `name` in `registry`, `steps` steps.
pub fn show(registry: &Path, name: &str, steps: usize) -> Result<PublicationEntry> {
    Ok(listing::list_publication(
        registry,
        name,
        &ListOptions { steps },
    )?)
}

fn opt_bytes(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "-".to_string(), human::bytes)
}

fn opt<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn ranks(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// `tessera live list`'s text: one line per publication.
pub fn list_text(listing: &RegistryListing) -> String {
    let mut out = String::new();
    let count = listing.publications.len();
    let _ = writeln!(
        out,
        "registry {}: {count} live publication{}",
        listing.registry,
        if count == 1 { "" } else { "s" }
    );
    if count > 0 {
        let width = listing
            .publications
            .iter()
            .map(|p| p.name.len())
            .max()
            .unwrap_or(0)
            .max(4);
        let _ = writeln!(
            out,
            "{}  {:>15}  {:>8}  {:>5}  {:>10}  {:>7}",
            human::pad_right("name", width),
            "newest complete",
            "steps",
            "ranks",
            "bytes",
            "tensors"
        );
        for p in &listing.publications {
            let _ = writeln!(
                out,
                "{}  {:>15}  {:>8}  {:>5}  {:>10}  {:>7}",
                human::pad_right(&p.name, width),
                p.newest_complete
                    .map_or_else(|| "none".to_string(), |s| s.to_string()),
                p.steps_total,
                opt(p.world),
                opt_bytes(p.bytes),
                opt(p.tensors)
            );
        }
    }
    for problem in &listing.problems {
        let _ = writeln!(out, "problem: {problem}");
    }
    out
}

fn step_line(out: &mut String, s: &StepEntry) {
    let _ = writeln!(
        out,
        "  step {:>8}  {:<10}  ranks {}/{}  {:>10}  tensors {}  published {}  committed {}{}",
        s.step,
        s.state.as_str(),
        s.ranks.len(),
        opt(s.world),
        opt_bytes(s.bytes),
        opt(s.tensors),
        opt(s.published.as_deref()),
        opt(s.committed.as_deref()),
        if s.leases > 0 {
            format!("  leases {}", s.leases)
        } else {
            String::new()
        }
    );
    if s.state != StepState::Complete
        && let Some(detail) = &s.detail
    {
        let _ = writeln!(out, "      {detail}");
    }
    if !s.missing_ranks.is_empty() {
        let _ = writeln!(out, "      missing ranks: {}", ranks(&s.missing_ranks));
    }
    for problem in &s.problems {
        let _ = writeln!(out, "      problem: {problem}");
    }
}

/// `tessera live show`'s text: the publication, its newest complete step's servers, its steps.
pub fn show_text(p: &PublicationEntry) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "live publication {} ({})", p.name, p.dir);
    match p.newest_complete {
        Some(step) => {
            let _ = writeln!(
                out,
                "newest complete step {step} (live://{}): {} publisher rank{}, {}, {} tensors",
                p.name,
                opt(p.world),
                if p.world == Some(1) { "" } else { "s" },
                opt_bytes(p.bytes),
                opt(p.tensors)
            );
            for publisher in &p.publishers {
                let _ = writeln!(
                    out,
                    "  rank {:>5}  {}/{}  {}",
                    publisher.rank,
                    publisher.url,
                    publisher.path,
                    opt_bytes(publisher.bytes)
                );
            }
        }
        None => {
            let _ = writeln!(out, "no complete step: live://{} loads nothing yet", p.name);
        }
    }
    let _ = writeln!(
        out,
        "steps: {} in all, {} listed{}",
        p.steps_total,
        p.steps.len(),
        if p.steps_truncated {
            " (the newest; --steps lists more)"
        } else {
            ""
        }
    );
    for step in &p.steps {
        step_line(&mut out, step);
    }
    out
}
