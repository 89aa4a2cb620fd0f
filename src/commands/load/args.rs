//! `tessera load`'s flags: one definition, parsed by clap from the command line and handed whole,
//! as JSON, to the rank processes the command spawns (`spawn`; the token aside).

use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{ArgAction, ArgGroup, Args};
use tessera_loader::device::DeviceSpec;
use tessera_planner::ReadOrder;

use crate::commands::StorageArgs;
use crate::commands::select::TensorFilter;

/// How ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Threads of this process.
    InProc,
    /// Separate processes over TCP (loopback when run by `load` itself).
    Tcp,
    /// Separate processes, TCP for control and NCCL for data, GPU to GPU (feature `cuda`).
    Nccl,
}

impl TransportKind {
    const ALL: [TransportKind; 3] = [
        TransportKind::InProc,
        TransportKind::Tcp,
        TransportKind::Nccl,
    ];

    /// Its `--transport` value.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::InProc => "inproc",
            TransportKind::Tcp => "tcp",
            TransportKind::Nccl => "nccl",
        }
    }

    /// `--transport`'s parser: one of [`TransportKind::name`].
    fn parser() -> impl TypedValueParser<Value = TransportKind> {
        PossibleValuesParser::new(Self::ALL.map(Self::name)).map(|name| {
            Self::ALL
                .into_iter()
                .find(|kind| kind.name() == name)
                .unwrap_or(TransportKind::InProc)
        })
    }
}

/// `--read-order`'s parser: the planner's [`ReadOrder`] by name, each value with its help.
fn read_order_parser() -> impl TypedValueParser<Value = ReadOrder> {
    PossibleValuesParser::new([
        PossibleValue::new("auto")
            .help("Per chunk, whichever the planner's cost model finds cheaper"),
        PossibleValue::new("request")
            .help("Each rank reads the pieces it needs, whatever the target cuts"),
        PossibleValue::new("storage")
            .help("Saved chunks read in storage-order slabs, the parts others need relayed"),
    ])
    .map(|name| match name.as_str() {
        "request" => ReadOrder::Request,
        "storage" => ReadOrder::Storage,
        _ => ReadOrder::Auto,
    })
}

/// `--device`: `cpu`, `cuda` or `cuda:N`.
fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    text.parse()
        .map_err(|e: tessera_loader::LoaderError| e.to_string())
}

/// `tessera load`'s arguments (its help is the `Load` command's doc). The rank processes it
/// spawns take them whole, as JSON (`spawn`), the token aside.
#[derive(Args, Clone, Debug, serde::Serialize, serde::Deserialize)]
#[command(group(ArgGroup::new("target").required(true).args(["layout", "requests"])))]
pub struct LoadArgs {
    /// Checkpoint location: a local directory, or a file://, s3://, gs://, az:// or
    /// http(s):// URL.
    pub checkpoint: String,
    /// Target layout JSON file.
    #[arg(long)]
    pub layout: Option<String>,
    /// Explicit requests JSON file.
    #[arg(long)]
    pub requests: Option<String>,
    /// Write DIR/rank-<r>.safetensors with every tensor box each rank ends up with.
    #[arg(long)]
    pub dump: Option<String>,
    /// How ranks exchange pieces: threads of this process, separate processes over TCP, or
    /// separate processes over NCCL, GPU to GPU (needs --device cuda and one GPU per rank).
    #[arg(long, default_value = "inproc", value_parser = TransportKind::parser())]
    pub transport: TransportKind,
    /// Where the loaded tensors go: host memory (cpu), or GPU memory (cuda: each rank on
    /// GPU LOCAL_RANK, or its rank modulo the GPU count; cuda:N: GPU N). GPU loading needs a
    /// build with `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceSpec,
    /// Run only this rank (a real job; rendezvous from --master-addr/--master-port or torchrun's
    /// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    #[arg(long)]
    pub rank: Option<u32>,
    /// World size (with --rank; must match the layout).
    #[arg(long)]
    pub world: Option<u32>,
    /// Rendezvous host: where rank 0 listens (with --rank; default: MASTER_ADDR).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Rendezvous port (with --rank; default: MASTER_PORT).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Skip block checksum verification of what is read.
    #[arg(long = "no-verify", action = ArgAction::SetFalse)]
    pub verify: bool,
    /// Every rank reads all it needs itself (no exchange).
    #[arg(long = "no-dedup", action = ArgAction::SetFalse)]
    pub dedup: bool,
    /// Largest gap in bytes between two small ranges of a file that one storage request may
    /// span, reading the gap too (fewer requests for more bytes). Default: 0 for local
    /// files, 65536 for object stores (s3://, gs://, az://, http(s)://). The report counts
    /// the bytes transferred, gaps included.
    #[arg(long, env = "TESSERA_COALESCE_GAP", value_name = "BYTES")]
    pub coalesce_gap: Option<u64>,
    /// Check every loaded byte against the synthetic value formula (synthetic checkpoints).
    #[arg(long)]
    pub check: bool,
    /// This host's memory tier (the directory a save left copies in, `memory_tier=`): each
    /// rank offers the copies of this checkpoint it finds there (each box verified), and
    /// every piece held there is read from it, once, instead of from storage. With --rank,
    /// each rank names its own node's tier. Not with --server or --transport nccl.
    #[arg(long, value_name = "DIR")]
    pub memory_tier: Option<String>,
    /// Seconds a rank waits for a peer before failing: to join the rendezvous, to connect, or
    /// to send; with --transport tcp, also how long the other ranks get after one failed.
    /// The one timeout of the rendezvous: waiting ranks say whom they wait for meanwhile.
    #[arg(long, default_value_t = 60.0)]
    pub peer_timeout: f64,
    /// Write the JSON report to a file: with --rank, that rank's report; otherwise
    /// {"totals": ..., "ranks": [...]}. Both name read_amplification (data read / bytes
    /// needed) and io_amplification (bytes fetched, checksum blocks included / bytes needed).
    #[arg(long)]
    pub report_json: Option<String>,
    /// How saved chunks are read: `auto` lets the planner's cost model pick per chunk
    /// between reading each rank's pieces where the target cuts them (`request`) and reading
    /// a chunk in storage-order slabs whose parts other ranks need are relayed through the
    /// exchange (`storage`: a column reshard of a row-sharded checkpoint then reads each byte
    /// and checksum block once, in few requests). `--transport nccl` always reads by request.
    #[arg(long, default_value = "auto", value_parser = read_order_parser())]
    pub read_order: ReadOrder,
    /// Write the load's counters (bytes needed, read, requested, transferred; storage
    /// requests and retries; bytes sent and received; seconds), one series per rank, in the
    /// OpenMetrics text format, e.g. for a node_exporter textfile collector.
    #[arg(long, value_name = "PATH")]
    pub metrics_file: Option<String>,
    /// No progress bar and no report on stdout.
    #[arg(long)]
    pub quiet: bool,
    /// Print one JSON document on stdout (on failure {"error": {"kind", "code", "message"}};
    /// see "Machine output" in `tessera --help`).
    #[arg(long)]
    pub json: bool,
    /// Only tensors whose name matches this glob (`*` any run of characters, dots included;
    /// `?` one character); repeatable. Patterns also match the checkpoint's plain
    /// (non-tensor) values' keys; one that matches neither is an error.
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Leave out tensors whose name matches this glob (after --include); repeatable, e.g.
    /// `--exclude 'optim.*'` for the model weights only.
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Fetch the plan from this tessera server (http://host:port) instead of planning here.
    #[arg(long)]
    pub server: Option<String>,
    /// The checkpoint's id on the server, <run>/<step> (default: the location's last two
    /// components).
    #[arg(long)]
    pub checkpoint_id: Option<String>,
    /// Bearer token of the server.
    // Never written to a file: spawned ranks get it in their environment.
    #[arg(long, env = super::TOKEN_ENV, hide_env_values = true)]
    #[serde(skip)]
    pub token: Option<String>,
    /// Registry directory of live publications, for a checkpoint given as live://NAME (the
    /// newest complete step) or live://NAME@STEP (what tessera.publish was given as registry=).
    #[arg(long, value_name = "DIR")]
    pub registry: Option<std::path::PathBuf>,
    /// How patient the checkpoint's storage requests are.
    #[command(flatten)]
    pub storage: StorageArgs,
}

impl LoadArgs {
    /// The tensors `--include` and `--exclude` take.
    pub fn filter(&self) -> TensorFilter {
        TensorFilter {
            include: self.include.clone(),
            exclude: self.exclude.clone(),
        }
    }

    /// `--peer-timeout`, refused unless a positive number of seconds (clap takes any number).
    pub fn peer_timeout(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.peer_timeout)
            .ok()
            .filter(|timeout| !timeout.is_zero())
            .ok_or_else(|| anyhow::anyhow!("--peer-timeout must be a positive number of seconds"))
    }
}
