//! The `tessera` command: synthesize, inspect, plan, load, verify and serve checkpoints.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{ArgGroup, Args, CommandFactory, Parser, Subcommand, ValueEnum};
use tessera::commands::{self, layout::Preset, plan::Format};
use tessera_planner::presets::MegatronGpt;
use tessera_synth::Model;
use tessera_synth::SynthOptions;

use tessera::commands::StorageArgs;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Checkpoint resharding and loading",
    after_help = tessera::exit::EXIT_CODES_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a small synthetic catalog in a local directory, reshard it for a few layouts, then
    /// serve it with the web UI (until Ctrl-C).
    Demo {
        /// Catalog directory (created when absent; existing checkpoints are reused).
        #[arg(long, default_value = "tessera-demo")]
        dir: String,
        /// Address to serve the catalog and web UI on (port 0 picks a free one).
        #[arg(long, default_value = tessera_server::DEFAULT_ADDR)]
        addr: String,
        /// Print the report and exit without serving.
        #[arg(long)]
        no_serve: bool,
    },
    /// Print the layout JSON of a preset.
    Layout {
        #[command(subcommand)]
        preset: PresetArgs,
    },
    /// Write a synthetic checkpoint saved with a layout.
    Synth {
        /// gpt-tiny, gpt-small, llama3-8b, llama3-70b or llama3-405b.
        #[arg(long)]
        model: String,
        /// Save layout JSON file (`-` for stdin).
        #[arg(long)]
        layout: String,
        /// Checkpoint directory to create.
        #[arg(long)]
        out: String,
        /// Write metadata only (no data files): for models too large to materialize.
        #[arg(long)]
        metadata_only: bool,
        /// Leave out optimizer states.
        #[arg(long)]
        no_optimizer: bool,
        /// Save the optimizer states as Megatron-Core's distributed optimizer does: the TP-local
        /// boxes of each state laid end to end in reverse model order and split into equal
        /// contiguous parts over the data-parallel mesh dim named here (default `dp`), each rank
        /// writing flat ranges of those boxes (uneven, mid-row cuts). The layout must replicate
        /// the optimizer states over that dim (e.g. `megatron-gpt` without `--zero1`).
        #[arg(long, value_name = "DP_DIM", num_args = 0..=1, default_missing_value = "dp")]
        dist_optimizer_flat: Option<String>,
        /// Training step recorded in the manifest.
        #[arg(long)]
        step: Option<u64>,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
    },
    /// Plan loading a checkpoint into a layout (or explicit per-rank requests).
    Plan(PlanCommand),
    /// Load a checkpoint into a layout: every rank here, or one rank of a real job (--rank).
    Load(commands::load::LoadArgs),
    /// One rank of `tessera load --transport tcp|nccl` as that command spawns it: the job's
    /// arguments whole from the JSON file it wrote, this rank's own from the flags.
    #[command(hide = true)]
    LoadRank {
        /// The job's arguments, as the spawning `tessera load` wrote them.
        args: std::path::PathBuf,
        /// This rank.
        #[arg(long)]
        rank: u32,
        /// The rendezvous port on loopback.
        #[arg(long)]
        master_port: u16,
        /// Where this rank's report goes (the spawning load reads it).
        #[arg(long)]
        report_json: String,
    },
    /// Re-save a checkpoint in another layout, or export consolidated safetensors.
    Convert {
        /// Source checkpoint location: a local directory, or a file://, s3://, gs://, az:// or
        /// http(s):// URL.
        checkpoint: String,
        /// Target layout JSON file (native format output).
        #[arg(long)]
        layout: Option<String>,
        /// Output format: native (needs --layout) or safetensors (consolidated shards + index).
        #[arg(long, value_enum, default_value_t = ConvertFormat::Native)]
        format: ConvertFormat,
        /// Output checkpoint directory or URL.
        #[arg(long)]
        out: String,
        /// Largest safetensors shard in bytes.
        #[arg(long, default_value_t = 5 * 1024 * 1024 * 1024)]
        max_shard_bytes: u64,
        /// Remove another writer's claim on --out first: only when that writer is known to be
        /// dead (killed, its host gone), or two writers will mix their files.
        #[arg(long)]
        break_claim: bool,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
        /// Only tensors and plain (non-tensor) values whose name matches this glob (`*` any run
        /// of characters, dots included; `?` one character); repeatable. A pattern that matches
        /// no tensor and no plain value is an error.
        #[arg(long, value_name = "GLOB")]
        include: Vec<String>,
        /// Leave out tensors and plain values whose name matches this glob (after --include);
        /// repeatable, e.g. `--exclude 'optim.*'` for the model weights only, `--exclude
        /// 'train_state.*'` to drop a train state.
        #[arg(long, value_name = "GLOB")]
        exclude: Vec<String>,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Show what a checkpoint holds.
    Inspect {
        /// Checkpoint location: a local directory, or a file://, s3://, gs://, az:// or
        /// http(s):// URL.
        checkpoint: String,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Check every block checksum of a checkpoint's data files.
    Verify {
        /// Checkpoint location: a local directory, or a file://, s3://, gs://, az:// or
        /// http(s):// URL.
        checkpoint: String,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Remove what failed or killed saves left under a storage root: directories with native
    /// data files, metadata or a write claim but no manifest.json. A directory whose claim is
    /// held by a live writer (a save in progress) is kept unless --break-claims.
    Gc {
        /// Storage root: a local directory (or file:// URL), or an s3://, gs:// or az:// prefix,
        /// searched recursively.
        root: String,
        /// List what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// Also remove leftovers whose claim names a live writer, a writer on another host, or
        /// is unreadable. Only when those writers are surely gone.
        #[arg(long)]
        break_claims: bool,
        /// ROOT is a node's memory tier (the directory saves were given as `memory_tier=`):
        /// prune it to the newest --keep copies and at most --max-bytes, and remove what saves
        /// that died before their commit left there. Only copy folders tessera made (with their
        /// marker) are listed or removed; a ROOT that is, holds or lies inside a checkpoint is
        /// refused.
        #[arg(long)]
        memory_tier: bool,
        /// With --memory-tier: checkpoints kept, newest first.
        #[arg(long, default_value_t = tessera_ops::memory_tier::DEFAULT_KEEP, value_name = "N", requires = "memory_tier")]
        keep: usize,
        /// With --memory-tier: bytes the tier may hold (the oldest copies go first).
        #[arg(long, value_name = "BYTES", requires = "memory_tier")]
        max_bytes: Option<u64>,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
    },
    /// Serve the catalog and plan API of a storage root over HTTP (until Ctrl-C or SIGTERM).
    Serve(ServeCommand),
    /// List the live publications (tessera.publish) of a registry directory: each one's newest
    /// complete step, publisher ranks and bytes, and its steps' states.
    Live {
        #[command(subcommand)]
        command: LiveCommand,
    },
    /// Print a shell completion script, e.g. `tessera completions bash >
    /// ~/.local/share/bash-completion/completions/tessera`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `tessera man | man -l -`; with --dir, write one page per
    /// command there (tessera.1, tessera-load.1, ...).
    Man {
        /// Write tessera.1 and a page per subcommand into this directory instead.
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
    },
}

/// `tessera plan`'s arguments (its help is the `Plan` variant's doc).
#[derive(Args)]
#[command(group(ArgGroup::new("target").required(true).args(["layout", "requests"])))]
struct PlanCommand {
    /// Checkpoint location: a local directory, or a file://, s3://, gs://, az:// or
    /// http(s):// URL.
    checkpoint: String,
    /// Target layout JSON file.
    #[arg(long)]
    layout: Option<String>,
    /// Explicit requests JSON file: {"ranks": [[{"fqn", "offsets", "lengths"} | {"fqn", "flat": [s, e]}]]}.
    #[arg(long)]
    requests: Option<String>,
    /// Print this rank's plan instead of the summary.
    #[arg(long)]
    rank: Option<u32>,
    /// Output format: text for people (a rank plan's reads, buffers and peers), json, or
    /// arrow (Arrow IPC; rank plans only).
    #[arg(long, value_enum, default_value_t = FormatArg::Text)]
    format: FormatArg,
    /// The same as --format json (one JSON document on stdout, errors included).
    #[arg(long, conflicts_with = "format")]
    json: bool,
    /// Also print the whole-plan summary (to stderr when a rank plan goes to stdout).
    #[arg(long)]
    summary: bool,
    /// Every rank reads all it needs itself (no read dedup, no exchange).
    #[arg(long)]
    no_dedup: bool,
    /// Most memory planning may take by the planner's estimate, in MiB (the bound of
    /// `tessera serve`); over it the plan is refused before it starts, with the estimate.
    #[arg(long, default_value_t = commands::serve::DEFAULT_PLAN_MEMORY_MIB)]
    plan_memory_mib: u64,
    #[command(flatten)]
    storage: StorageArgs,
}

/// `tessera live`'s subcommands.
#[derive(Subcommand)]
enum LiveCommand {
    /// Every publication of the registry: newest complete step (what live://NAME loads),
    /// steps, publisher ranks, bytes, tensors.
    List {
        /// The registry directory (what publishers were given as registry=).
        #[arg(long)]
        registry: std::path::PathBuf,
        /// Steps of each publication read, newest first (JSON lists them; the text gives the
        /// summary).
        #[arg(long, default_value_t = tessera_ops::publish::listing::DEFAULT_LISTED_STEPS)]
        steps: usize,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
    },
    /// One publication: its newest complete step's publisher ranks and servers, and its newest
    /// steps with their state (complete; incomplete naming the ranks whose parts are missing;
    /// retired), bytes and times.
    Show {
        /// The publication's name (live://NAME).
        name: String,
        /// The registry directory (what publishers were given as registry=).
        #[arg(long)]
        registry: std::path::PathBuf,
        /// Steps listed, newest first.
        #[arg(long, default_value_t = tessera_ops::publish::listing::DEFAULT_LISTED_STEPS)]
        steps: usize,
        /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
        /// see "Machine output" in `tessera --help`).
        #[arg(long)]
        json: bool,
    },
}

/// `tessera serve`'s arguments (its help is the `Serve` variant's doc).
#[derive(Args)]
struct ServeCommand {
    /// Catalog root: a local directory or URL (file://, s3://, gs://, az://, http(s)://)
    /// holding <run>/<step> checkpoint directories.
    #[arg(long)]
    root: String,
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, default_value = tessera_server::DEFAULT_ADDR)]
    addr: String,
    /// Bearer token every /v1 route and /metrics require (default: the TESSERA_TOKEN
    /// variable; none leaves them open). /healthz and /readyz never need it.
    #[arg(long)]
    token: Option<String>,
    /// Directory of a static web UI served at / (default: the built-in catalog browser).
    #[arg(long)]
    web_ui: Option<std::path::PathBuf>,
    /// Registry directory of live publications (what tessera.publish was given as
    /// registry=): /v1/live, the catalog and the web UI list them next to the checkpoints.
    #[arg(long)]
    registry: Option<std::path::PathBuf>,
    /// Allow browsers on this origin to call the API (repeatable; `*` for any). Off by default.
    #[arg(long = "cors-origin")]
    cors_origins: Vec<String>,
    /// Memory for checkpoint metadata, in MiB.
    #[arg(long, default_value_t = commands::serve::DEFAULT_METADATA_CACHE_MIB)]
    metadata_cache_mib: u64,
    /// Memory for computed plans, in MiB.
    #[arg(long, default_value_t = commands::serve::DEFAULT_PLAN_CACHE_MIB)]
    plan_cache_mib: u64,
    /// Largest request body, in KiB.
    #[arg(long, default_value_t = commands::serve::DEFAULT_BODY_LIMIT_KIB)]
    body_limit_kib: usize,
    /// Most memory one plan computation may take by the planner's estimate, in MiB (over
    /// it a plan request is refused with 422 and the estimate).
    #[arg(long, default_value_t = commands::serve::DEFAULT_PLAN_MEMORY_MIB)]
    plan_memory_mib: u64,
    /// Plan computations running at once.
    #[arg(long, default_value_t = tessera_server::DEFAULT_PLAN_CONCURRENCY)]
    plan_concurrency: usize,
    /// Plan computations waiting beyond those running (one more gets 503 with Retry-After).
    #[arg(long, default_value_t = tessera_server::DEFAULT_PLAN_QUEUE)]
    plan_queue: usize,
    /// Seconds a connection may take to send a request head (also how long an idle
    /// keep-alive connection is kept).
    #[arg(long, default_value_t = commands::serve::DEFAULT_HEADER_TIMEOUT_SECS)]
    header_timeout_secs: u64,
    /// Seconds a request may take to send its whole body, counted once from the end of its
    /// head (408 past it).
    #[arg(long, default_value_t = commands::serve::DEFAULT_BODY_TIMEOUT_SECS)]
    body_timeout_secs: u64,
    /// Connections served at once (one more replaces the connection idle longest; it is
    /// closed on arrival only when every connection has a request in flight).
    #[arg(long, default_value_t = tessera_server::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
}

impl Command {
    /// Whether the command was asked for machine output (`--json`, `plan --format json`): then
    /// an error, too, is a JSON document on stdout.
    fn json(&self) -> bool {
        match self {
            Command::Synth { json, .. }
            | Command::Load(commands::load::LoadArgs { json, .. })
            | Command::Convert { json, .. }
            | Command::Inspect { json, .. }
            | Command::Verify { json, .. }
            | Command::Gc { json, .. }
            | Command::Live {
                command: LiveCommand::List { json, .. } | LiveCommand::Show { json, .. },
            } => *json,
            Command::Plan(PlanCommand { json, format, .. }) => {
                *json || matches!(format, FormatArg::Json)
            }
            _ => false,
        }
    }
}

#[derive(Subcommand)]
enum PresetArgs {
    /// Everything shard(0) over dp.
    Fsdp {
        /// Data-parallel ranks.
        #[arg(long)]
        dp: u32,
    },
    /// Megatron GPT: mesh (pp, dp, tp), column/row-parallel TP, stages by layer.
    MegatronGpt {
        /// Tensor-parallel size.
        #[arg(long)]
        tp: u32,
        /// Pipeline-parallel size.
        #[arg(long)]
        pp: u32,
        /// Data-parallel size.
        #[arg(long)]
        dp: u32,
        /// Number of transformer layers.
        #[arg(long)]
        num_layers: u64,
        /// Optimizer states also shard(0) over dp (distributed optimizer / ZeRO-1).
        #[arg(long)]
        zero1: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ConvertFormat {
    Native,
    Safetensors,
}

#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    Text,
    Json,
    Arrow,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            // A bad command line: clap's message on stderr and its code 2; a script that asked
            // for --json still gets the error document (help and --version are not errors).
            if error.use_stderr() && std::env::args().any(|a| a == "--json") {
                let doc = tessera::exit::usage_json(&error.render().to_string());
                let _ = writeln!(std::io::stdout(), "{doc:#}");
            }
            error.exit()
        }
    };
    let json = cli.command.json();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`tessera inspect --json | head`): nothing left to say to it.
        Err(err) if commands::is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            // Every failure goes through here: its class picks the exit code (see `tessera
            // --help`); with --json the error is also the JSON document on stdout.
            let class = tessera::exit::classify(&err);
            if json {
                let doc = tessera::exit::error_json(&err);
                let _ = writeln!(std::io::stdout(), "{doc:#}");
            }
            eprintln!("error: {}", commands::error_text::error_text(&err));
            ExitCode::from(class.code())
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Demo {
            dir,
            addr,
            no_serve,
        } => demo(&runtime, dir, addr, no_serve),
        Command::Layout { preset } => {
            stdout((commands::layout::run(&preset.into_preset())? + "\n").as_bytes())
        }
        Command::Synth {
            model,
            layout,
            out,
            metadata_only,
            no_optimizer,
            dist_optimizer_flat,
            step,
            json,
        } => {
            let model: Model = model.parse()?;
            if no_optimizer && dist_optimizer_flat.is_some() {
                anyhow::bail!(
                    "--dist-optimizer-flat saves optimizer states; --no-optimizer leaves them out"
                );
            }
            let options = SynthOptions {
                model,
                optimizer: !no_optimizer,
                metadata_only,
                dist_optimizer: dist_optimizer_flat,
                step,
                progress: Some(std::sync::Arc::new(print_file_written)),
            };
            let report = runtime.block_on(commands::synth::run(&out, &layout, &options))?;
            stdout_report(json, &report, || report.text() + "\n")
        }
        Command::Plan(plan) => stdout(&runtime.block_on(commands::plan::run(&plan.into_args()?))?),
        Command::Load(args) => {
            let report = runtime.block_on(commands::load::run(&args))?;
            if args.quiet {
                Ok(())
            } else {
                stdout(report.as_bytes())
            }
        }
        Command::LoadRank {
            args,
            rank,
            master_port,
            report_json,
        } => {
            let args = commands::load::rank_args(&args, rank, master_port, report_json)?;
            runtime.block_on(commands::load::run(&args)).map(drop)
        }
        Command::Convert {
            checkpoint,
            layout,
            format,
            out,
            max_shard_bytes,
            break_claim,
            json,
            include,
            exclude,
            storage,
        } => {
            let options = commands::convert::ConvertOptions {
                break_claim,
                retry: storage.policy()?,
                filter: commands::select::TensorFilter { include, exclude },
            };
            let report = runtime.block_on(convert(
                &checkpoint,
                format,
                layout.as_deref(),
                &out,
                max_shard_bytes,
                &options,
            ))?;
            stdout_report(json, &report, || report.text())
        }
        Command::Inspect {
            checkpoint,
            json,
            storage,
        } => stdout(
            runtime
                .block_on(commands::inspect::run(
                    &checkpoint,
                    json,
                    &storage.policy()?,
                ))?
                .as_bytes(),
        ),
        Command::Serve(serve) => runtime.block_on(commands::serve::run(&serve.into_args())),
        Command::Verify {
            checkpoint,
            json,
            storage,
        } => {
            let text = runtime.block_on(commands::verify::run(&checkpoint, &storage.policy()?))?;
            if json {
                stdout(commands::verify::json_report(&checkpoint, &text).as_bytes())
            } else {
                stdout(text.as_bytes())
            }
        }
        Command::Gc {
            root,
            dry_run,
            break_claims,
            memory_tier,
            keep,
            max_bytes,
            json,
        } => {
            if memory_tier {
                gc_memory_tier(&root, dry_run, break_claims, keep, max_bytes, json)
            } else {
                gc(&root, dry_run, break_claims, json)
            }
        }
        Command::Live { command } => live(command),
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "tessera", &mut out);
            stdout(&out)
        }
        Command::Man { dir } => man(dir),
    }
}

/// `demo`: the synthetic catalog's report, then (unless `no_serve`) the catalog served at `addr`.
fn demo(
    runtime: &tokio::runtime::Runtime,
    dir: String,
    addr: String,
    no_serve: bool,
) -> Result<()> {
    stdout(runtime.block_on(commands::demo::run(&dir))?.as_bytes())?;
    if no_serve {
        return Ok(());
    }
    stdout(b"\nserving the catalog and its web UI (Ctrl-C stops):\n")?;
    runtime.block_on(commands::serve::run(&commands::serve::ServeArgs::new(
        dir, addr,
    )))
}

/// `live list` and `live show`: a registry's publications, or one, as text or JSON.
fn live(command: LiveCommand) -> Result<()> {
    match command {
        LiveCommand::List {
            registry,
            steps,
            json,
        } => {
            let listing = commands::live::list(&registry, steps)?;
            stdout_report(json, &listing, || commands::live::list_text(&listing))
        }
        LiveCommand::Show {
            name,
            registry,
            steps,
            json,
        } => {
            let publication = commands::live::show(&registry, &name, steps)?;
            stdout_report(json, &publication, || {
                commands::live::show_text(&publication)
            })
        }
    }
}

/// Writes `bytes` to stdout and flushes them.
fn stdout(bytes: &[u8]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)?;
    out.flush()?;
    Ok(())
}

/// Writes a command's report to stdout: with --json as one pretty JSON document, else as the
/// `text` it renders to.
fn stdout_report(
    json: bool,
    report: &impl serde::Serialize,
    text: impl FnOnce() -> String,
) -> Result<()> {
    if json {
        stdout(format!("{:#}\n", serde_json::to_value(report)?).as_bytes())
    } else {
        stdout(text().as_bytes())
    }
}

/// `synth`'s progress line on stderr, one per data file written.
fn print_file_written(w: &tessera_synth::FileWritten) {
    eprintln!(
        "  rank {:>5}: {} in {} ({}/{} files, {:.1}s)",
        w.rank,
        w.path,
        tessera::human::bytes(w.bytes),
        w.done,
        w.total,
        w.elapsed.as_secs_f64()
    );
}

/// `convert` to the format asked: the native format needs a layout, safetensors (consolidated
/// tensors) refuses one.
async fn convert(
    checkpoint: &str,
    format: ConvertFormat,
    layout: Option<&str>,
    out: &str,
    max_shard_bytes: u64,
    options: &commands::convert::ConvertOptions,
) -> Result<commands::convert::ConvertReport> {
    match (format, layout) {
        (ConvertFormat::Native, Some(layout)) => {
            commands::convert::to_layout(checkpoint, layout, out, options).await
        }
        (ConvertFormat::Native, None) => {
            anyhow::bail!("convert to the native format needs --layout")
        }
        (ConvertFormat::Safetensors, None) => {
            commands::convert::to_safetensors(checkpoint, out, max_shard_bytes, options).await
        }
        (ConvertFormat::Safetensors, Some(_)) => {
            anyhow::bail!("--format safetensors writes consolidated tensors; drop --layout")
        }
    }
}

/// `man`: the man page on stdout, or one page per command written into `dir`.
fn man(dir: Option<std::path::PathBuf>) -> Result<()> {
    match dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(Cli::command(), &dir)
                .with_context(|| format!("writing man pages into {}", dir.display()))?;
            stdout(format!("wrote the man pages into {}\n", dir.display()).as_bytes())
        }
        None => {
            let mut out = Vec::new();
            clap_mangen::Man::new(Cli::command()).render(&mut out)?;
            stdout(&out)
        }
    }
}

impl PresetArgs {
    /// The planner's preset these arguments name.
    fn into_preset(self) -> Preset {
        match self {
            PresetArgs::Fsdp { dp } => Preset::Fsdp { dp },
            PresetArgs::MegatronGpt {
                tp,
                pp,
                dp,
                num_layers,
                zero1,
            } => Preset::MegatronGpt(MegatronGpt {
                tp,
                pp,
                dp,
                num_layers,
                zero1,
            }),
        }
    }
}

impl PlanCommand {
    /// The plan's arguments (`--json` is `--format json`).
    fn into_args(self) -> Result<commands::plan::PlanArgs> {
        Ok(commands::plan::PlanArgs {
            checkpoint: self.checkpoint,
            layout: self.layout,
            requests: self.requests,
            rank: self.rank,
            format: match self.format {
                _ if self.json => Format::Json,
                FormatArg::Text => Format::Text,
                FormatArg::Json => Format::Json,
                FormatArg::Arrow => Format::Arrow,
            },
            summary: self.summary,
            no_dedup: self.no_dedup,
            plan_memory_bytes: self.plan_memory_mib.saturating_mul(1024 * 1024),
            retry: self.storage.policy()?,
        })
    }
}

/// `gc --memory-tier`: prunes a node's memory tier (claims are a storage root's, refused here).
fn gc_memory_tier(
    root: &str,
    dry_run: bool,
    break_claims: bool,
    keep: usize,
    max_bytes: Option<u64>,
    json: bool,
) -> Result<()> {
    if break_claims {
        anyhow::bail!("--break-claims is for a storage root; a memory tier has no claims");
    }
    let pruned = commands::gc::prune_memory_tier(root, keep, max_bytes, dry_run)?;
    stdout_report(json, &pruned, || {
        commands::gc::memory_tier_text(root, &pruned, dry_run)
    })
}

/// `gc` of a storage root: removes what failed or killed saves left.
fn gc(root: &str, dry_run: bool, break_claims: bool, json: bool) -> Result<()> {
    let options = commands::gc::GcOptions {
        dry_run,
        break_claims,
    };
    let report = commands::gc::run(root, &options)?;
    if json {
        stdout(commands::gc::json_report(&report)?.as_bytes())
    } else {
        stdout(commands::gc::text_report(&report).as_bytes())
    }
}

impl ServeCommand {
    /// The server's arguments, flag for flag.
    fn into_args(self) -> commands::serve::ServeArgs {
        commands::serve::ServeArgs {
            root: self.root,
            addr: self.addr,
            token: self.token,
            web_ui: self.web_ui,
            registry: self.registry,
            cors_origins: self.cors_origins,
            metadata_cache_mib: self.metadata_cache_mib,
            plan_cache_mib: self.plan_cache_mib,
            body_limit_kib: self.body_limit_kib,
            plan_memory_mib: self.plan_memory_mib,
            plan_concurrency: self.plan_concurrency,
            plan_queue: self.plan_queue,
            header_timeout_secs: self.header_timeout_secs,
            body_timeout_secs: self.body_timeout_secs,
            max_connections: self.max_connections,
        }
    }
}
