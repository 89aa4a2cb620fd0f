//! `tessera load`: load a checkpoint into a layout, every rank on this machine (in-process or as
//! separate processes over TCP or NCCL on loopback) or one rank of a real job (`--rank`), into
//! host memory or GPU memory (`--device cuda[:N]`, feature `cuda`), with a report.

#[cfg(feature = "cuda")]
mod gpu;
mod metrics;

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use anyhow::{Context, Result, anyhow, bail};
use tessera_loader::device::{CUDA_BUILT, DeviceSpec, cuda_not_built};
use tessera_loader::load::{Checkpoint, LoadOptions, LoadedRank, RankReport, load_rank};
use tessera_loader::plan_client::{
    CreatedPlan, PlanClient, PlanClientOptions, PlanTarget, server_checkpoint_id,
};
use tessera_loader::read::ReadOptions;
use tessera_loader::rendezvous::RendezvousConfig;
use tessera_loader::transport::InProcTransport;
use tessera_loader::transport::TcpTransport;
use tessera_loader::transport::TransportOptions;
use tessera_metadata::Format;
use tessera_metadata::formats::dcp::IndexSource;
use tessera_metadata::formats::safetensors::{self, TensorView};
use tessera_planner::{
    ExplicitRequests, Plan, PlanOptions, PlanSummary, RankPlan, ReadOrder, RequestSet, Target,
};
use tessera_synth as synth;

use crate::human;

/// How ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// Threads of this process.
    InProc,
    /// Separate processes over TCP (loopback when run by `load` itself).
    Tcp,
    /// Separate processes, TCP for control and NCCL for data, GPU to GPU (feature `cuda`).
    Nccl,
}

impl TransportKind {
    fn name(self) -> &'static str {
        match self {
            TransportKind::InProc => "inproc",
            TransportKind::Tcp => "tcp",
            TransportKind::Nccl => "nccl",
        }
    }
}

/// Arguments of `tessera load`.
#[derive(Clone, Debug)]
pub struct LoadArgs {
    /// Checkpoint location.
    pub checkpoint: String,
    /// Target layout JSON file.
    pub layout: Option<String>,
    /// Explicit requests JSON file.
    pub requests: Option<String>,
    /// Write `DIR/rank-<r>.safetensors` per rank.
    pub dump: Option<String>,
    /// Transport between ranks.
    pub transport: TransportKind,
    /// Where the destination buffers live.
    pub device: DeviceSpec,
    /// Run only this rank (a real job's rank; rendezvous from flags or torchrun's environment).
    pub rank: Option<u32>,
    /// World size with `--rank`.
    pub world: Option<u32>,
    /// Rendezvous address with `--rank`.
    pub master_addr: Option<String>,
    /// Rendezvous port with `--rank`.
    pub master_port: Option<u16>,
    /// Verify block checksums of what is read.
    pub verify: bool,
    /// Read each shared piece once and exchange it.
    pub dedup: bool,
    /// Largest gap one storage request may span (`--coalesce-gap`); `None`: the store kind's
    /// default (`tessera_loader::read::default_coalesce_gap`).
    pub coalesce_gap: Option<u64>,
    /// Check every loaded byte against the synthetic value formula.
    pub check: bool,
    /// Write the JSON report here (used by the per-rank processes of `--transport tcp`).
    pub report_json: Option<String>,
    /// Write the load's counters here in the OpenMetrics text format (`--metrics-file`).
    pub metrics_file: Option<String>,
    /// How saved chunks are read (`--read-order`).
    pub read_order: ReadOrder,
    /// Seconds a rank waits for a peer before giving up.
    pub peer_timeout: Duration,
    /// Print the progress bar and report.
    pub quiet: bool,
    /// Fetch rank plans from this tessera server instead of planning here.
    pub server: Option<String>,
    /// The checkpoint's id on the server (`<run>/<step>`); by default the last two components
    /// of the checkpoint location.
    pub checkpoint_id: Option<String>,
    /// Bearer token of the server (the CLI fills it from `TESSERA_TOKEN` when not given).
    pub token: Option<String>,
    /// Timeouts and attempts of every storage request, for the store and the reads alike
    /// (`--storage-read-timeout`, `--storage-attempts`): with a store that stalls, they bound
    /// how soon the load fails (docs/retry.md).
    pub retry: tessera_storage::RetryPolicy,
    /// Load only the tensors this takes (`--include`, `--exclude`).
    pub filter: super::select::TensorFilter,
    /// Print the report as one JSON document (`--json`).
    pub json: bool,
}

/// Where rank plans come from: planned here from the checkpoint (the default, no service
/// needed), or a tessera server that plans once for the whole job.
enum Planned {
    Local(Plan),
    Server {
        client: PlanClient,
        created: CreatedPlan,
    },
}

impl Planned {
    fn world(&self) -> u32 {
        match self {
            Planned::Local(plan) => plan.world_size(),
            Planned::Server { created, .. } => created.world,
        }
    }

    fn summary(&self) -> &PlanSummary {
        match self {
            Planned::Local(plan) => plan.summary(),
            Planned::Server { created, .. } => &created.summary,
        }
    }

    async fn rank_plan(&self, rank: u32) -> Result<RankPlan> {
        Ok(match self {
            Planned::Local(plan) => plan.rank_plan(rank)?,
            Planned::Server { client, created } => client
                .rank_plan(&created.plan, rank)
                .await
                .with_context(|| format!("fetching rank {rank}'s plan from the server"))?,
        })
    }
}

async fn plan_on_server(args: &LoadArgs, server: &str, checkpoint: &Checkpoint) -> Result<Planned> {
    let id = match &args.checkpoint_id {
        Some(id) => id.clone(),
        None => server_checkpoint_id(&args.checkpoint).with_context(|| {
            format!(
                "cannot tell the server-side id of {}; give --checkpoint-id <run>/<step>",
                args.checkpoint
            )
        })?,
    };
    let target = match (&args.layout, &args.requests) {
        (Some(layout), None) => PlanTarget::Layout(super::read_layout(layout)?),
        (None, Some(path)) => PlanTarget::Requests(
            ExplicitRequests::from_json(&super::read_text(path)?)
                .with_context(|| format!("reading requests {path}"))?,
        ),
        _ => bail!("give exactly one of --layout or --requests"),
    };
    let client = PlanClient::new(
        server,
        PlanClientOptions {
            token: args.token.clone(),
            dedup: args.dedup,
            ..PlanClientOptions::default()
        },
    )?;
    let created = client
        .create_plan(&id, &target)
        .await
        .with_context(|| format!("planning {id} on {server}"))?;
    // The server plans from its own catalog: refuse at once (before any rank reads) a plan made
    // for another version of the checkpoint than the one opened here. Each rank's plan is checked
    // again when it is loaded.
    if let (None, Some(opened)) = (
        created.checkpoint_identity.as_deref(),
        checkpoint.meta.identity(),
    ) {
        bail!(
            "{server} did not say which version of checkpoint {id} its plan is for (no \
             checkpoint_identity: a server older than this client), so the plan cannot be checked \
             against {} (identity {opened}); upgrade the server, or load without --server",
            args.checkpoint
        );
    }
    if let (Some(planned), Some(opened)) = (
        created.checkpoint_identity.as_deref(),
        checkpoint.meta.identity(),
    ) && planned != opened
    {
        bail!(
            "the server's plan is for another version of checkpoint {}: {server} planned {id} \
             with identity {planned}, but the checkpoint opened here has identity {opened} \
             (it was saved again, or the server's {id} is another checkpoint; check \
             --checkpoint-id and plan again)",
            args.checkpoint
        );
    }
    Ok(Planned::Server { client, created })
}

/// Refuses what this build or the arguments cannot do, before any work.
fn check_device(args: &LoadArgs) -> Result<()> {
    if args.device.is_cuda() && !CUDA_BUILT {
        return Err(cuda_not_built(&format!("--device {}", args.device)).into());
    }
    // No driver: say so now, not after opening and planning the checkpoint.
    #[cfg(feature = "cuda")]
    if args.device.is_cuda() {
        tessera_loader::cuda::probe::driver()?;
    }
    if args.transport == TransportKind::Nccl {
        if !CUDA_BUILT {
            return Err(cuda_not_built("--transport nccl").into());
        }
        if !args.device.is_cuda() {
            bail!("--transport nccl moves data between GPUs: give --device cuda (or cuda:N)");
        }
    }
    Ok(())
}

/// Runs the command; returns the report text.
pub async fn run(args: &LoadArgs) -> Result<String> {
    check_device(args)?;
    // Rank processes spawned here share the DCP blob index through a cache directory, so the
    // zip headers are read once (by this process), not once per rank.
    let shared_cache = match (args.rank, args.transport) {
        (None, TransportKind::Tcp) if std::env::var_os(super::CACHE_DIR_ENV).is_none() => {
            Some(tempfile::tempdir().context("creating a directory for the shared blob index")?)
        }
        _ => None,
    };
    let mut open_options = super::open_options();
    if let Some(dir) = &shared_cache {
        open_options.dcp.cache_dir = Some(dir.path().to_path_buf());
    }
    let location =
        tessera_storage::open_with(&args.checkpoint, &super::storage_options(&args.retry))?;
    tessera_ops::open::check_local(&args.checkpoint)
        .with_context(|| format!("opening checkpoint {}", args.checkpoint))?;
    let checkpoint = Checkpoint::open_with(location, &open_options)
        .await
        .with_context(|| format!("opening checkpoint {}", args.checkpoint))?;
    if !checkpoint.has_data {
        bail!(
            "{}: a metadata-only checkpoint has no data to load",
            args.checkpoint
        );
    }
    let started = Instant::now();
    let plan = match &args.server {
        Some(_) if !args.filter.is_everything() => bail!(
            "--include/--exclude filter a plan made here; a server plans every tensor (drop --server)"
        ),
        Some(server) => plan_on_server(args, server, &checkpoint).await?,
        None => {
            let requests = requests_for(args, &checkpoint)?;
            Planned::Local(checkpoint.plan(
                &requests,
                &PlanOptions {
                    dedup: args.dedup,
                    // The device ring cannot relay pieces read in storage order.
                    read_order: if args.transport == TransportKind::Nccl {
                        ReadOrder::Request
                    } else {
                        args.read_order
                    },
                    ..PlanOptions::default()
                },
            )?)
        }
    };
    let plan_seconds = started.elapsed().as_secs_f64();
    let options = LoadOptions {
        read: ReadOptions {
            verify: args.verify,
            retry: args.retry.clone(),
            coalesce_gap: args.coalesce_gap,
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    };
    // One bound for every wait on a peer, rendezvous included (it had its own 300 s default).
    let transport_options = TransportOptions {
        timeout: args.peer_timeout,
        connect_timeout: args.peer_timeout,
        progress_every: Some(progress_interval(args.peer_timeout)),
    };

    #[cfg(feature = "cuda")]
    if args.device.is_cuda() {
        return gpu::run(
            args,
            &checkpoint,
            &plan,
            plan_seconds,
            options,
            transport_options,
            shared_cache.as_ref().map(|d| d.path()),
        )
        .await;
    }

    if let Some(rank) = args.rank {
        let world = plan.world();
        if let Some(w) = args.world
            && w != world
        {
            bail!("--world {w} but the layout has {world} ranks");
        }
        let config = rendezvous(args, rank, world)?;
        let transport = TcpTransport::connect(&config, transport_options).await?;
        let loaded = load_rank(
            &checkpoint,
            plan.rank_plan(rank).await?,
            &transport,
            &options,
        )
        .await?;
        finish_rank(args, &loaded)?;
        if let Some(path) = &args.report_json {
            std::fs::write(path, serde_json::to_vec(&loaded.report)?)
                .with_context(|| format!("writing {path}"))?;
        }
        if let Some(path) = &args.metrics_file {
            metrics::write_metrics(path, std::slice::from_ref(&loaded.report))?;
        }
        return Ok(report(
            args,
            &checkpoint,
            &plan,
            &[loaded.report],
            plan_seconds,
            "tcp, one rank",
        ));
    }

    let reports = match args.transport {
        TransportKind::InProc => {
            load_all_inproc(args, &checkpoint, &plan, options, transport_options).await?
        }
        TransportKind::Tcp | TransportKind::Nccl => {
            load_all_tcp(args, plan.world(), shared_cache.as_ref().map(|d| d.path())).await?
        }
    };
    let kind = match args.transport {
        TransportKind::InProc => "in-process".to_string(),
        TransportKind::Tcp | TransportKind::Nccl => {
            format!("{} processes on 127.0.0.1", args.transport.name())
        }
    };
    if let Some(path) = &args.report_json {
        write_all_ranks_json(path, &plan, &reports)?;
    }
    if let Some(path) = &args.metrics_file {
        metrics::write_metrics(path, &reports)?;
    }
    Ok(report(
        args,
        &checkpoint,
        &plan,
        &reports,
        plan_seconds,
        &kind,
    ))
}

fn requests_for(args: &LoadArgs, checkpoint: &Checkpoint) -> Result<RequestSet> {
    let mut requests = match (&args.layout, &args.requests) {
        (Some(path), None) => {
            let layout = super::read_layout(path)?;
            let requests = layout
                .resolve(checkpoint.meta.tensors())
                .with_context(|| format!("resolving layout {path} against {}", args.checkpoint))?;
            // Once per job: every rank of a real job resolves the same layout.
            if args.rank.unwrap_or(0) == 0 {
                super::warn_layout(path, &layout, checkpoint.meta.tensors());
            }
            requests
        }
        (None, Some(path)) => ExplicitRequests::from_json(&super::read_text(path)?)
            .and_then(|r| r.resolve(checkpoint.meta.tensors()))
            .with_context(|| format!("reading requests {path}"))?,
        _ => bail!("give exactly one of --layout or --requests"),
    };
    args.filter
        .apply(&mut requests, checkpoint.meta.tensors(), &args.checkpoint)?;
    Ok(requests)
}

/// How often a waiting rank says whom it waits for: every 5 s, more often for a short timeout
/// (a quarter of it, at least 1 s) so that a wait always says something before it fails.
fn progress_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// A fingerprint of what this job loads: everything the plan depends on (checkpoint, layout or
/// requests as text, server and checkpoint id, dedup, world). Rank 0 refuses a rank whose
/// fingerprint differs. FNV-1a: stable across processes and builds, unlike std's hasher.
fn job_fingerprint(args: &LoadArgs, world: u32) -> Result<u64> {
    let mut parts: Vec<Vec<u8>> = vec![args.checkpoint.clone().into_bytes()];
    for path in [&args.layout, &args.requests].into_iter().flatten() {
        parts.push(super::read_text(path)?.into_bytes());
    }
    parts.push(args.server.clone().unwrap_or_default().into_bytes());
    parts.push(args.checkpoint_id.clone().unwrap_or_default().into_bytes());
    parts.push(vec![u8::from(args.dedup)]);
    parts.push(world.to_le_bytes().to_vec());
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in &parts {
        // Length first, so that ("ab", "c") and ("a", "bc") differ.
        for byte in (part.len() as u64).to_le_bytes().iter().chain(part) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok(hash)
}

fn rendezvous(args: &LoadArgs, rank: u32, world: u32) -> Result<RendezvousConfig> {
    let job = job_fingerprint(args, world)?;
    Ok(rendezvous_config(args, rank, world)?.with_job(job))
}

fn rendezvous_config(args: &LoadArgs, rank: u32, world: u32) -> Result<RendezvousConfig> {
    rendezvous_from(
        args.master_addr.as_deref(),
        args.master_port,
        rank,
        world,
        |name| std::env::var(name).ok(),
    )
}

/// The rendezvous of `--rank`: the master address and port each from its flag, else from
/// torchrun's variable (`var` looks those up). `--rank` and the world are given, so only what is
/// missing is asked for; RANK and WORLD_SIZE, when set, must agree with them (a launcher that
/// sets them for another rank is a mistake worth stopping on).
fn rendezvous_from(
    master_addr: Option<&str>,
    master_port: Option<u16>,
    rank: u32,
    world: u32,
    var: impl Fn(&str) -> Option<String>,
) -> Result<RendezvousConfig> {
    let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let addr = master_addr
        .map(str::to_string)
        .or_else(|| var("MASTER_ADDR").map(|v| v.trim().to_string()));
    let port = match master_port {
        Some(port) => Some(port),
        None => match var("MASTER_PORT") {
            Some(text) => Some(text.trim().parse::<u16>().map_err(|_| {
                anyhow::anyhow!("MASTER_PORT={text:?} is not a TCP port (0 to 65535)")
            })?),
            None => None,
        },
    };
    let missing: Vec<&str> = [
        addr.is_none()
            .then_some("the master address (--master-addr HOST or MASTER_ADDR)"),
        port.is_none()
            .then_some("the master port (--master-port PORT or MASTER_PORT)"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let (Some(master_addr), Some(master_port)) = (addr, port) else {
        bail!(
            "--rank {rank} joins a job of {world} ranks through rank 0, but {} not given: \
             every rank needs rank 0's address (torchrun sets MASTER_ADDR and MASTER_PORT)",
            match missing.as_slice() {
                [one] => format!("{one} is"),
                _ => format!("{} are", missing.join(" and ")),
            }
        );
    };
    for (name, value, what) in [
        ("RANK", rank, format!("--rank {rank}")),
        (
            "WORLD_SIZE",
            world,
            format!("the layout's world size {world}"),
        ),
    ] {
        if let Some(text) = var(name)
            && text.trim() != value.to_string()
        {
            bail!("{what} disagrees with {name}={text} in the environment");
        }
    }
    Ok(RendezvousConfig::new(
        rank,
        world,
        master_addr,
        master_port,
    )?)
}

async fn load_all_inproc(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &Planned,
    mut options: LoadOptions,
    transport_options: TransportOptions,
) -> Result<Vec<RankReport>> {
    let world = plan.world();
    let total = plan.summary().bytes_read;
    // A bar only where a person watches: not with --quiet, not into a pipe or a log file.
    let bar = (!args.quiet && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "  read {binary_bytes} of {binary_total_bytes} ({percent}%) {wide_bar} {binary_bytes_per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    if let Some(bar) = bar.clone() {
        options.progress = Some(Arc::new(move |bytes| bar.inc(bytes)));
    }
    let transports = InProcTransport::mesh(world, transport_options);
    let mut tasks = Vec::with_capacity(world as usize);
    for (rank, transport) in transports.into_iter().enumerate() {
        let rank_plan = plan.rank_plan(rank as u32).await?;
        let checkpoint = checkpoint.clone();
        let options = options.clone();
        tasks.push(tokio::spawn(async move {
            load_rank(&checkpoint, rank_plan, &transport, &options).await
        }));
    }
    let mut reports = Vec::with_capacity(tasks.len());
    let mut failures = Vec::new();
    let mut classes = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        match task.await {
            Ok(Ok(loaded)) => {
                finish_rank(args, &loaded)?;
                reports.push(loaded.report);
            }
            Ok(Err(e)) => {
                classes.push(crate::exit::classify_loader(&e));
                failures.push(format!("rank {rank}: {e}"));
            }
            Err(e) => {
                classes.push(crate::exit::ErrorClass::Other);
                failures.push(format!("rank {rank}: task failed: {e}"));
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if !failures.is_empty() {
        // Its own type: the exit code is that of the rank whose trouble made the others fail.
        return Err(crate::exit::RanksFailed {
            failures,
            class: crate::exit::root_class(classes),
        }
        .into());
    }
    Ok(reports)
}

/// Runs every rank as its own `tessera load --rank` process, rendezvousing on a free loopback port.
async fn load_all_tcp(
    args: &LoadArgs,
    world: u32,
    shared_cache: Option<&std::path::Path>,
) -> Result<Vec<RankReport>> {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
        listener.local_addr()?.port()
    };
    let reports_dir = tempfile::tempdir().context("creating a report directory")?;
    let exe = std::env::current_exe().context("locating the tessera binary")?;
    let mut children = Vec::with_capacity(world as usize);
    for rank in 0..world {
        let report = reports_dir.path().join(format!("rank-{rank}.json"));
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("load").arg(&args.checkpoint);
        if let Some(layout) = &args.layout {
            cmd.arg("--layout").arg(layout);
        }
        if let Some(requests) = &args.requests {
            cmd.arg("--requests").arg(requests);
        }
        if let Some(dump) = &args.dump {
            cmd.arg("--dump").arg(dump);
        }
        if let Some(server) = &args.server {
            // Every rank asks the server; it plans once (the same request gives the same plan).
            cmd.arg("--server").arg(server);
            if let Some(id) = &args.checkpoint_id {
                cmd.arg("--checkpoint-id").arg(id);
            }
            if let Some(token) = &args.token {
                cmd.env("TESSERA_TOKEN", token);
            }
        }
        cmd.args([
            "--transport",
            match args.transport {
                TransportKind::Nccl => "nccl",
                _ => "tcp",
            },
            "--device",
            &args.device.to_string(),
            "--rank",
            &rank.to_string(),
            "--world",
            &world.to_string(),
        ])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .args([
            "--peer-timeout",
            &args.peer_timeout.as_secs_f64().to_string(),
            "--quiet",
        ])
        // The same storage timeouts in every rank (flags win over the environment there too).
        .args([
            "--storage-read-timeout",
            &args.retry.read_timeout.as_secs_f64().to_string(),
            "--storage-attempts",
            &args.retry.max_attempts.to_string(),
        ])
        .arg("--report-json")
        .arg(&report);
        // Every rank plans the same filtered requests.
        cmd.args(args.filter.describe());
        if !args.verify {
            cmd.arg("--no-verify");
        }
        if let Some(gap) = args.coalesce_gap {
            cmd.args(["--coalesce-gap", &gap.to_string()]);
        }
        if !args.dedup {
            cmd.arg("--no-dedup");
        }
        // Every rank must plan with the same read order, or their plans would not match.
        cmd.args([
            "--read-order",
            match args.read_order {
                ReadOrder::Auto => "auto",
                ReadOrder::Request => "request",
                ReadOrder::Storage => "storage",
            },
        ]);
        if args.check {
            cmd.arg("--check");
        }
        if let Some(dir) = shared_cache {
            cmd.env(super::CACHE_DIR_ENV, dir);
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push((rank, report, child));
    }
    let outcomes = supervise(children, args.peer_timeout).await;
    let mut failures = Vec::new();
    let mut classes = Vec::new();
    let mut reports = Vec::new();
    for (rank, report, outcome) in outcomes {
        match outcome {
            RankOutcome::Succeeded => {
                let text = std::fs::read(&report)
                    .with_context(|| format!("reading rank {rank}'s report"))?;
                reports.push(
                    serde_json::from_slice(&text)
                        .with_context(|| format!("parsing rank {rank}'s report"))?,
                );
            }
            RankOutcome::Failed(message) => {
                // Killed or vanished: to its peers, a peer that failed.
                classes.push(crate::exit::ErrorClass::PeerFailed);
                failures.push(format!("rank {rank}: {message}"));
            }
            RankOutcome::Exited(message, code) => {
                classes.push(crate::exit::ErrorClass::from_code(code));
                failures.push(format!("rank {rank}: {message}"));
            }
        }
    }
    if !failures.is_empty() {
        // Its own type: the exit code is that of the rank whose trouble made the others fail
        // (each rank process exits with its own class's code).
        return Err(crate::exit::RanksFailed {
            failures,
            class: crate::exit::root_class(classes),
        }
        .into());
    }
    Ok(reports)
}

/// How one rank process ended.
enum RankOutcome {
    Succeeded,
    /// Its error, or what became of it when it left none.
    Failed(String),
    /// Its error, and the exit code it chose (which says the class of its failure).
    Exited(String, i32),
}

/// Waits for every rank process, all at once, reading their stderr as they go (a full pipe
/// would block a rank). A rank that stops making progress (SIGSTOPped, hung in a syscall) never
/// exits and its peers only time out on it; waiting for it would hang `load` forever. So once
/// any rank has failed, the others get `grace` (the peer timeout: every live rank that waits on a
/// failed one fails by itself within it) and are then killed, each reported with what became of
/// it. The parent therefore ends within about twice the peer timeout of the first failure.
async fn supervise(
    mut children: Vec<(u32, std::path::PathBuf, tokio::process::Child)>,
    grace: Duration,
) -> Vec<(u32, std::path::PathBuf, RankOutcome)> {
    use futures::StreamExt;
    let (kill_tx, kill_rx) = tokio::sync::watch::channel(false);
    let mut waits = futures::stream::FuturesUnordered::new();
    for (index, (rank, _, child)) in children.iter_mut().enumerate() {
        let rank = *rank;
        let stderr = child.stderr.take();
        let mut kill_rx = kill_rx.clone();
        let pid = child.id();
        waits.push(async move {
            let read_stderr = async {
                let mut text = String::new();
                if let Some(pipe) = stderr {
                    use tokio::io::AsyncBufReadExt;
                    let mut lines = tokio::io::BufReader::new(pipe).lines();
                    // A killed rank's pipe closes with it; a read error only loses its message.
                    while let Ok(Some(line)) = lines.next_line().await {
                        // Progress ("rank 0: waiting for ranks 2,3 to join") is passed on as it
                        // comes, so that a waiting load is not silent.
                        if line.starts_with("rank ") && line.contains(": waiting for ") {
                            eprintln!("{line}");
                        } else {
                            text.push_str(&line);
                            text.push('\n');
                        }
                    }
                }
                text
            };
            let wait = async {
                tokio::select! {
                    status = child.wait() => (status, None),
                    _ = kill_rx.wait_for(|kill| *kill) => {
                        // Seen before the kill: a SIGSTOPped rank shows state T.
                        let state = pid.and_then(process_state);
                        let _ = child.start_kill();
                        (child.wait().await, Some(state))
                    }
                }
            };
            let (text, (status, killed)) = tokio::join!(read_stderr, wait);
            (index, rank, rank_outcome(status, killed, &text, grace))
        });
    }
    let mut outcomes: Vec<Option<RankOutcome>> = (0..waits.len()).map(|_| None).collect();
    let mut kill_at: Option<tokio::time::Instant> = None;
    loop {
        let next = match kill_at {
            Some(at) => match tokio::time::timeout_at(at, waits.next()).await {
                Ok(next) => next,
                Err(_) => {
                    let _ = kill_tx.send(true);
                    kill_at = None;
                    continue;
                }
            },
            None => waits.next().await,
        };
        let Some((index, _rank, outcome)) = next else {
            break;
        };
        if matches!(outcome, RankOutcome::Failed(_) | RankOutcome::Exited(..))
            && kill_at.is_none()
            && !*kill_tx.borrow()
        {
            kill_at = Some(tokio::time::Instant::now() + grace);
        }
        outcomes[index] = Some(outcome);
    }
    drop(waits);
    children
        .into_iter()
        .zip(outcomes)
        .map(|((rank, report, _), outcome)| {
            let outcome = outcome.unwrap_or_else(|| {
                RankOutcome::Failed("its process could not be waited for".to_string())
            });
            (rank, report, outcome)
        })
        .collect()
}

/// What became of a rank process: success, its own error message, or (when it left none) how it
/// ended: killed by us after the grace period (and whether it was stopped then), killed by a
/// signal from elsewhere, or an exit code.
fn rank_outcome(
    status: std::io::Result<std::process::ExitStatus>,
    killed: Option<Option<char>>,
    stderr: &str,
    grace: Duration,
) -> RankOutcome {
    let status = match status {
        Ok(status) if status.success() => return RankOutcome::Succeeded,
        Ok(status) => status,
        Err(e) => return RankOutcome::Failed(format!("waiting for its process failed: {e}")),
    };
    let message = stderr.trim().trim_start_matches("error: ");
    if let Some(state) = killed {
        let how = match state {
            Some('T') | Some('t') => "stopped (SIGSTOP or a debugger)",
            _ => "still running",
        };
        let mut line = format!(
            "{how} {:.0} s after another rank failed: killed by signal 9, no report",
            grace.as_secs_f64()
        );
        if !message.is_empty() {
            line.push_str(&format!(" (it had printed: {message})"));
        }
        return RankOutcome::Failed(line);
    }
    if !message.is_empty() {
        return match status.code() {
            Some(code) => RankOutcome::Exited(message.to_string(), code),
            None => RankOutcome::Failed(message.to_string()),
        };
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return RankOutcome::Failed(format!("killed by signal {signal}, no report"));
        }
    }
    match status.code() {
        Some(code) => RankOutcome::Exited(format!("exited with code {code}, no report"), code),
        None => RankOutcome::Failed("ended without an exit code, no report".to_string()),
    }
}

/// The state letter of process `pid` (`R`, `S`, `T` for stopped, ...) from `/proc`, where there
/// is one.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may hold spaces and parentheses, so look after the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Per-rank work after loading: value check and dump.
fn finish_rank(args: &LoadArgs, loaded: &LoadedRank) -> Result<()> {
    let plan = &loaded.plan;
    if args.check {
        for (dest, buffer) in plan.destinations.iter().zip(&loaded.buffers) {
            let tensor = &plan.tensors[dest.tensor as usize];
            let checked = match &dest.target {
                Target::Box(region) => synth::check_box(tensor, region, buffer),
                Target::Flat { start, end } => synth::check_flat(tensor, *start, *end, buffer),
            };
            checked.map_err(|e| anyhow!("rank {}: {e}", plan.rank))?;
        }
    }
    if let Some(dir) = &args.dump {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {dir}"))?;
        let shapes: Vec<Vec<u64>> = plan
            .destinations
            .iter()
            .map(|d| d.target.buffer_shape())
            .collect();
        let names = dump_names(
            plan.destinations
                .iter()
                .map(|d| plan.tensors[d.tensor as usize].fqn.as_str()),
        );
        let views: Vec<TensorView<'_>> = plan
            .destinations
            .iter()
            .enumerate()
            .map(|(i, dest)| TensorView {
                name: &names[i],
                dtype: plan.tensors[dest.tensor as usize].dtype,
                shape: &shapes[i],
                data: &loaded.buffers[i],
            })
            .collect();
        let bytes = safetensors::serialize(&views, None)?;
        let path = std::path::Path::new(dir).join(format!("rank-{}.safetensors", plan.rank));
        let tmp = path.with_extension("safetensors.tmp");
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {}", tmp.display()))?;
    }
    Ok(())
}

/// Unique safetensors names for a rank's destinations, in order: a tensor's FQN, or `FQN#k` (the
/// first free k) when the rank holds several boxes of it. Linear in the number of destinations:
/// a hash set of the names taken and, per FQN, the last k tried (a name once taken stays taken,
/// so the search for the next free k can start there); the list scan it replaces made a 100k
/// tensor dump take about a minute.
pub fn dump_names<'a>(fqns: impl Iterator<Item = &'a str>) -> Vec<String> {
    let fqns = fqns.collect::<Vec<_>>();
    let mut taken: HashSet<String> = HashSet::with_capacity(fqns.len());
    let mut next_k: HashMap<&str, u64> = HashMap::new();
    let mut names = Vec::with_capacity(fqns.len());
    for fqn in fqns {
        let mut name = fqn.to_string();
        if taken.contains(&name) {
            let k = next_k.entry(fqn).or_insert(1);
            name = format!("{fqn}#{k}");
            while taken.contains(&name) {
                *k += 1;
                name = format!("{fqn}#{k}");
            }
        }
        taken.insert(name.clone());
        names.push(name);
    }
    names
}

/// The load's totals over every rank that reported, as the text report and `--report-json` (all
/// ranks) give them.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LoadTotals {
    /// Ranks that reported.
    pub ranks: usize,
    /// Bytes of every rank's buffers.
    pub bytes_needed: u64,
    /// Distinct bytes of the checkpoint that the ranks need (the plan's summary).
    pub unique_needed: u64,
    /// Bytes of data read from storage, over all ranks.
    pub bytes_read: u64,
    /// Bytes fetched from storage, verification blocks included.
    pub bytes_fetched: u64,
    /// Of `bytes_fetched`, the bytes only verification needed (checksum blocks around the data,
    /// the rest of boxes read whole to check their crc32c).
    pub verify_extra_bytes: u64,
    /// Saved boxes fetched whole and checked against their own crc32c.
    pub boxes_verified: u64,
    /// `bytes_read / unique_needed`: 1.00 when no byte is read twice or needlessly.
    pub read_amplification: f64,
    /// `bytes_fetched / unique_needed`: total I/O per byte needed, verification included.
    pub io_amplification: f64,
    /// Bytes the stores returned, over all ranks: `bytes_fetched` plus the gaps that requests
    /// spanning several small ranges carried (`--coalesce-gap`).
    pub bytes_transferred: u64,
    /// `bytes_transferred / unique_needed`: what the wire carried per byte needed.
    pub transfer_amplification: f64,
    /// Storage requests over all ranks (one ranged GET each; retries not included).
    pub requests: u64,
    /// Bytes ranks sent each other.
    pub bytes_exchanged: u64,
    /// Of `bytes_exchanged`, the bytes receivers copied straight out of their sender's memory
    /// (ranks on one host; no socket).
    pub bytes_exchanged_direct: u64,
}

impl LoadTotals {
    fn new(plan: &Planned, reports: &[RankReport]) -> Self {
        let sum = |f: fn(&RankReport) -> u64| reports.iter().map(f).sum::<u64>();
        let unique = plan.summary().unique_bytes_needed;
        let (read, fetched) = (sum(|r| r.bytes_read), sum(|r| r.bytes_fetched));
        LoadTotals {
            ranks: reports.len(),
            bytes_needed: sum(|r| r.bytes_needed),
            unique_needed: unique,
            bytes_read: read,
            bytes_fetched: fetched,
            verify_extra_bytes: sum(|r| r.verify_extra_bytes),
            boxes_verified: sum(|r| r.boxes_verified),
            read_amplification: tessera_loader::load::ratio(read, unique),
            io_amplification: tessera_loader::load::ratio(fetched, unique),
            bytes_transferred: sum(|r| r.bytes_transferred),
            transfer_amplification: tessera_loader::load::ratio(
                sum(|r| r.bytes_transferred),
                unique,
            ),
            requests: sum(|r| r.requests),
            bytes_exchanged: sum(|r| r.bytes_sent),
            bytes_exchanged_direct: sum(|r| r.bytes_received_direct),
        }
    }
}

/// The `--report-json` of a load of several ranks: the totals and every rank's own report.
fn write_all_ranks_json(path: &str, plan: &Planned, reports: &[RankReport]) -> Result<()> {
    let json = serde_json::json!({
        "totals": LoadTotals::new(plan, reports),
        "ranks": reports,
    });
    std::fs::write(path, serde_json::to_vec_pretty(&json)?)
        .with_context(|| format!("writing {path}"))
}

/// The report printed at the end: text, or with `--json` one JSON document.
fn report(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &Planned,
    reports: &[RankReport],
    plan_seconds: f64,
    kind: &str,
) -> String {
    if args.json {
        report_json(args, checkpoint, plan, reports, plan_seconds, kind)
    } else {
        report_text(args, checkpoint, plan, reports, plan_seconds, kind)
    }
}

/// `load --json`: the plan's totals and every rank's own report (the fields of
/// `--report-json`), under stable names.
fn report_json(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &Planned,
    reports: &[RankReport],
    plan_seconds: f64,
    kind: &str,
) -> String {
    let doc = serde_json::json!({
        "checkpoint": args.checkpoint,
        "format": checkpoint.format.name(),
        "transport": kind,
        "world": plan.world(),
        "ranks_loaded": reports.len(),
        "verified": args.verify,
        "plan_seconds": plan_seconds,
        "plan": plan.summary(),
        "totals": LoadTotals::new(plan, reports),
        "ranks": reports,
    });
    format!("{doc:#}\n")
}

fn report_text(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &Planned,
    reports: &[RankReport],
    plan_seconds: f64,
    kind: &str,
) -> String {
    let sum = |f: fn(&RankReport) -> u64| reports.iter().map(f).sum::<u64>();
    let max = |f: fn(&RankReport) -> f64| reports.iter().map(f).fold(0.0, f64::max);
    let needed = sum(|r| r.bytes_needed);
    let totals = LoadTotals::new(plan, reports);
    let (read, fetched, unique) = (
        totals.bytes_read,
        totals.bytes_fetched,
        totals.unique_needed,
    );
    let total = max(|r| r.total_seconds);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "loaded {} into {} of {} ranks ({kind})",
        args.checkpoint,
        reports.len(),
        plan.world()
    );
    let _ = writeln!(
        out,
        "bytes needed         {} (every rank's buffers)",
        human::bytes(needed)
    );
    // Two figures by name: what was read of the data (read amplification) and what the storage
    // served in all (I/O amplification), since checksum blocks around small tensors can be several
    // times the data they verify.
    let _ = writeln!(
        out,
        "bytes read           {} of data (unique needed {}, read amplification {:.2} = data read / needed)",
        human::bytes(read),
        human::bytes(unique),
        totals.read_amplification,
    );
    let boxes = sum(|r| r.boxes_verified);
    // Formats without checksums (and --no-verify) fetch nothing to verify: say nothing about it.
    let verification = if totals.verify_extra_bytes > 0 || boxes > 0 {
        format!(
            "{} only to verify: checksum blocks, boxes read whole; {boxes} boxes checked by their own crc32c; ",
            human::bytes(totals.verify_extra_bytes)
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "bytes fetched        {} ({verification}{} requests, {} retries)",
        human::bytes(fetched),
        sum(|r| r.requests),
        sum(|r| r.retries)
    );
    let _ = writeln!(
        out,
        "total I/O            {} = {:.2} x needed (I/O amplification = bytes fetched, verification included / needed)",
        human::bytes(fetched),
        totals.io_amplification,
    );
    // What the store actually returned: more than fetched only where one request spanned the gap
    // between small ranges (--coalesce-gap).
    let _ = writeln!(
        out,
        "bytes transferred    {} in {} requests = {:.2} x needed ({} of gaps spanned by --coalesce-gap)",
        human::bytes(totals.bytes_transferred),
        totals.requests,
        totals.transfer_amplification,
        human::bytes(totals.bytes_transferred.saturating_sub(fetched)),
    );
    match checkpoint.format {
        Format::Native => {}
        Format::Dcp => {
            let _ = writeln!(
                out,
                "format               PyTorch DCP, read in place without verification (DCP records no checksums of chunk bytes)"
            );
        }
        Format::ByteCheckpoint => {
            let _ = writeln!(
                out,
                "format               ByteCheckpoint, read in place without verification (ByteCheckpoint records no checksums of storage bytes)"
            );
        }
        Format::Safetensors => {
            let _ = writeln!(
                out,
                "format               safetensors, read in place without verification (safetensors records no checksums)"
            );
        }
        Format::DeepSpeed => {
            let _ = writeln!(
                out,
                "format               DeepSpeed ZeRO, read in place without verification (partial reads of torch.save records have no checksum)"
            );
        }
    }
    if let Some(index) = &checkpoint.index {
        let line = match index.source {
            IndexSource::Built => format!(
                "{} in {} requests at open, once for {} blobs ({:.1}% on top of the bytes read)",
                human::bytes(index.bytes_read),
                index.requests,
                index.blobs,
                if read == 0 {
                    0.0
                } else {
                    100.0 * index.bytes_read as f64 / read as f64
                }
            ),
            IndexSource::Memory => "none read: blob index from the in-memory cache".to_string(),
            IndexSource::Disk => "none read: blob index from the cache directory".to_string(),
        };
        let _ = writeln!(out, "zip headers          {line}");
    }
    let (exchanged, direct) = (sum(|r| r.bytes_sent), sum(|r| r.bytes_received_direct));
    let _ = writeln!(
        out,
        "bytes exchanged      {}{}",
        human::bytes(exchanged),
        if direct == 0 {
            String::new()
        } else if direct == exchanged {
            ", all copied directly between ranks' memory".to_string()
        } else {
            format!(
                ", {} copied directly between ranks' memory",
                human::bytes(direct)
            )
        }
    );
    let _ = writeln!(
        out,
        "time                 plan {plan_seconds:.3} s, read {:.3} s, exchange {:.3} s, total {total:.3} s (slowest rank)",
        max(|r| r.read_seconds),
        max(|r| r.exchange_seconds)
    );
    let _ = writeln!(
        out,
        "throughput           {:.2} GB/s of buffers filled",
        if total > 0.0 {
            needed as f64 / total / 1e9
        } else {
            0.0
        }
    );
    let h2d_bytes = sum(|r| r.h2d_bytes);
    if args.device.is_cuda() {
        let h2d_seconds = max(|r| r.h2d_seconds);
        let _ = writeln!(
            out,
            "h2d                  {} in {h2d_seconds:.3} s (slowest rank), {:.2} GB/s through pinned staging",
            human::bytes(h2d_bytes),
            if h2d_seconds > 0.0 {
                h2d_bytes as f64 / h2d_seconds / 1e9
            } else {
                0.0
            }
        );
    }
    if args.check {
        let _ = writeln!(
            out,
            "check                every byte matches the synthetic formula"
        );
    }
    if let Some(dir) = &args.dump {
        let _ = writeln!(out, "dump                 {dir}/rank-<r>.safetensors");
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_string())
        }
    }

    #[test]
    fn rank_without_master_says_what_is_missing() {
        let err = rendezvous_from(None, None, 1, 3, env(&[]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--rank 1 joins a job of 3 ranks through rank 0, but the master address \
             (--master-addr HOST or MASTER_ADDR) and the master port (--master-port PORT or \
             MASTER_PORT) are not given: every rank needs rank 0's address (torchrun sets \
             MASTER_ADDR and MASTER_PORT)"
        );
        assert!(!err.contains("RANK is not set"), "{err}");

        let err = rendezvous_from(Some("10.0.0.1"), None, 1, 3, env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("but the master port (--master-port PORT or MASTER_PORT) is not given"),
            "{err}"
        );
        assert!(!err.contains("master address"), "{err}");
    }

    #[test]
    fn flags_and_torchrun_variables_combine() {
        // A flag wins over its variable; the other comes from the environment.
        let vars = [("MASTER_ADDR", "10.0.0.9"), ("MASTER_PORT", "29500")];
        let config = rendezvous_from(Some("10.0.0.1"), None, 2, 4, env(&vars)).unwrap();
        assert_eq!(
            config,
            RendezvousConfig::new(2, 4, "10.0.0.1", 29500).unwrap()
        );
        let config = rendezvous_from(None, None, 2, 4, env(&vars)).unwrap();
        assert_eq!(
            config,
            RendezvousConfig::new(2, 4, "10.0.0.9", 29500).unwrap()
        );

        let bad_port = [("MASTER_ADDR", "h"), ("MASTER_PORT", "http")];
        let err = rendezvous_from(None, None, 0, 2, env(&bad_port))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "MASTER_PORT=\"http\" is not a TCP port (0 to 65535)");

        let other_rank = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "3")];
        let err = rendezvous_from(None, None, 1, 4, env(&other_rank))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "--rank 1 disagrees with RANK=3 in the environment");
        let other_world = [("WORLD_SIZE", "8")];
        let err = rendezvous_from(Some("h"), Some(1), 1, 4, env(&other_world))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the layout's world size 4 disagrees with WORLD_SIZE=8 in the environment"
        );
    }
}
