//! `fp8-moe`: the workspace's command-line front end.
//!
//! * `fp8-moe info`: the driver, each device, and which graph features they support.
//! * `fp8-moe bench graph [--json PATH]`: launch, replay, capture and update costs.
//! * `fp8-moe bench fp8-cast [--json PATH]`: FP8 quantize and cast-transpose bandwidth.
//! * `fp8-moe bench gemm [--json PATH]`: FP8 GEMM and grouped GEMM against cuBLASLt.
//! * `fp8-moe bench graphed [--json PATH]`: eager against graphed step time of the FP8 MLP
//!   stack.
//! * `fp8-moe bench moe [--tokens T] [--experts E] [--json PATH]`: one training step of the
//!   dropless top-k SwiGLU MoE layer, eager, breaking-layer and full-layer.
//! * `fp8-moe soak [--replays N] [--check-every N] [--update-every N] [--seed S]
//!   [--workload moe|mlp|both] [--max-seconds S] [--json PATH]`: replays the graphed MoE
//!   layer and MLP stack with changing data, checks them against eager, updates execs in
//!   between, and reports device and host memory drift; exits 1 on a mismatch or a drift of
//!   1 MiB or more.
//!
//! Arguments are parsed by `clap`: usage errors print the error and usage to stderr and exit
//! 2; `--help` and `--version` work for the tool and each subcommand. Runtime errors print one
//! line to stderr and exit 1; there is never a backtrace.

mod bench;
mod info;
mod soak;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, CommandFactory, Parser, Subcommand};
use fp8_moe::model::{GraphMode, ModelConfig, TrainConfig};
use fp8_moe::train;

/// FP8 mixture-of-experts layer run as CUDA graphs: device report and benchmarks.
#[derive(Debug, Parser)]
#[command(name = "fp8-moe", version, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    launch: LaunchArgs,
    #[command(subcommand)]
    command: Command,
}

/// Starting a multi-GPU job: `fp8-moe --gpus N <command>` runs N processes of `<command>`,
/// one per GPU, as torchrun does.
#[derive(Debug, Args)]
#[command(next_help_heading = "Multi-GPU (before the command)")]
struct LaunchArgs {
    /// Start N processes of the command, one per GPU of this machine. Each gets RANK,
    /// LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and NCCL_NVLS_ENABLE=0; their output
    /// lines come prefixed with "[rank R]". Runs `train --dp N`, `train --ep N` and `bench
    /// dist`.
    #[arg(long, value_name = "N")]
    gpus: Option<std::num::NonZeroUsize>,
    /// Machines in the job; start `fp8-moe --gpus N --nnodes M --node-rank R
    /// --master-addr A --master-port P ...` on each.
    #[arg(long, value_name = "M", default_value_t = 1, requires = "gpus")]
    nnodes: usize,
    /// This machine's index in the job (0 hosts the rendezvous).
    #[arg(long, value_name = "R", default_value_t = 0, requires = "gpus")]
    node_rank: usize,
    /// The address of node 0, where the ranks meet.
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1",
        requires = "gpus"
    )]
    master_addr: String,
    /// The port the ranks meet on [default: a free one; needed with --nnodes > 1].
    #[arg(long, value_name = "PORT", requires = "gpus")]
    master_port: Option<u16>,
}

/// The launcher's own flags, which the children must not see again.
const LAUNCH_FLAGS: [&str; 5] = [
    "--gpus",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
];

/// The command line without the launcher's flags (each `--flag VALUE` or `--flag=VALUE`
/// before the command): what every child runs.
fn strip_launch_flags(args: &[std::ffi::OsString]) -> Vec<std::ffi::OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let text = arg.to_str().unwrap_or("");
        if LAUNCH_FLAGS.contains(&text) {
            it.next();
        } else if LAUNCH_FLAGS.iter().any(|f| {
            text.strip_prefix(f)
                .is_some_and(|rest| rest.starts_with('='))
        }) {
        } else if !text.starts_with('-') {
            // The command: everything from here on is the child's.
            out.push(arg.clone());
            out.extend(it.cloned());
            break;
        } else {
            out.push(arg.clone());
        }
    }
    out
}

/// Runs `command` as a multi-process job (`--gpus`).
fn launch(args: &LaunchArgs, gpus: usize, command: &Command) -> Result<(), info::CliError> {
    // Every node starts `gpus` ranks.
    let world = gpus * args.nnodes.max(1);
    match command {
        Command::Bench(BenchArgs {
            bench: Bench::Dist, ..
        }) => {}
        Command::Train(t) if t.dp.max(t.ep) as usize == world && t.dp.min(t.ep) == 1 => {}
        Command::Train(t) => {
            let over = match args.nnodes {
                0 | 1 => format!("--gpus {gpus}"),
                n => format!("--gpus {gpus} over {n} nodes ({world} ranks)"),
            };
            return Err(info::CliError::Other(format!(
                "{over} train needs --dp {world} or --ep {world} (it has --dp {} --ep {}): \
                 data or expert parallelism over every rank",
                t.dp, t.ep
            )));
        }
        _ => {
            return Err(info::CliError::Other(
                "--gpus runs `bench dist`, `train --dp N` and `train --ep N` on several GPUs; \
                 the other commands run on one GPU"
                    .into(),
            ));
        }
    }
    let program = std::env::current_exe()
        .map_err(|e| info::CliError::Other(format!("cannot find this program: {e}")))?;
    let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let cfg = cuda_graph_nccl::launch::LaunchConfig {
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
        args: strip_launch_flags(&argv),
        ..cuda_graph_nccl::launch::LaunchConfig::new(gpus, program)
    };
    cuda_graph_nccl::launch::launch(&cfg)
        .map(|_| ())
        .map_err(|e| info::CliError::Other(e.to_string()))
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Driver version, devices, graph features of this driver.
    Info,
    /// Runs a benchmark, prints its table and writes its rows as JSON.
    Bench(BenchArgs),
    /// Replays the graphed FP8 MoE layer and FP8 MLP stack many times with changing data.
    ///
    /// New inputs every replay (MoE token counts per expert change on every replay), outputs
    /// compared with eager runs bit for bit every --check-every replays, whole-graph and
    /// per-node exec updates every --update-every replays (each followed by checked
    /// replays), device memory (cuMemGetInfo) and host RSS sampled after a warmup, during the
    /// run and at its end. Prints a table, writes JSON, and exits 1 on any mismatch or a
    /// memory drift of 1 MiB or more.
    Soak(SoakArgs),
    /// Trains a byte-level FP8 MoE transformer under CUDA graphs (the main job).
    ///
    /// Reads the corpus (--data, or this repository's text files), trains --steps steps in
    /// the --graphs mode with a progress bar, saves a checkpoint (--save), generates a sample
    /// under a CUDA graph, times every graph mode from the same start (their losses must equal
    /// eager's bit for bit) and writes the report folder: loss.svg, run.json and the captured
    /// graphs as DOT (SVG too when Graphviz's `dot` is installed).
    Train(Box<TrainArgs>),
}

/// The flags of `train`. Model and optimizer flags left out take the defaults below; with
/// --resume they all come from the checkpoint, and giving any of them is an error (a resumed
/// run continues the saved one exactly, schedule included).
#[derive(Debug, Args)]
struct TrainArgs {
    /// How each training step runs: eager launches, MoE breaking-layer graphs, a graph per
    /// block and pass, or the whole step as one graph.
    #[arg(long, value_enum, default_value_t = GraphMode::Step)]
    graphs: GraphMode,
    /// Optimizer steps of the whole run (a resumed run keeps its checkpoint's total and
    /// trains the rest) [default: 500].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    steps: Option<u64>,
    /// Transformer blocks [default: 4].
    #[arg(long, value_name = "N")]
    layers: Option<usize>,
    /// Model width; a multiple of 64 (heads of 64) [default: 512].
    #[arg(long, value_name = "D")]
    d_model: Option<usize>,
    /// Experts per MoE layer [default: 8].
    #[arg(long, value_name = "E")]
    experts: Option<usize>,
    /// Experts per token [default: 2].
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Each expert's FFN width [default: 1024].
    #[arg(long, value_name = "F")]
    ffn: Option<usize>,
    /// Context (tokens per sequence) [default: 256].
    #[arg(long, value_name = "S")]
    context: Option<usize>,
    /// Sequences per microbatch [default: 16].
    #[arg(long, value_name = "B")]
    batch: Option<usize>,
    /// Microbatches per step (gradient accumulation) [default: 4].
    #[arg(long, value_name = "M")]
    microbatches: Option<usize>,
    /// Peak learning rate (linear warmup, cosine decay to a tenth) [default: 1e-3].
    #[arg(long, value_name = "LR")]
    lr: Option<f32>,
    /// Warmup steps [default: 20].
    #[arg(long, value_name = "N")]
    warmup: Option<usize>,
    /// AdamW weight decay of the matrices [default: 0.1].
    #[arg(long, value_name = "WD")]
    weight_decay: Option<f32>,
    /// Gradient-norm clip [default: 1.0].
    #[arg(long, value_name = "NORM")]
    clip: Option<f32>,
    /// Seeds the weights and the data sampling [default: 1234].
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// The corpus: a file or a folder of text files [default: this repository's].
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// Save a checkpoint here at the end (replaced atomically).
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Continue the run saved here.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// The report folder.
    #[arg(long, value_name = "DIR", default_value = "train-report")]
    report: PathBuf,
    /// Validation loss every N steps (0: at the end only).
    #[arg(long, value_name = "N", default_value_t = 50)]
    eval_every: usize,
    /// Steps each graph mode runs for the comparison table (0: no table).
    #[arg(long, value_name = "N", default_value_t = 12)]
    compare_steps: usize,
    /// Bytes to generate at the end (0: none).
    #[arg(long, value_name = "N", default_value_t = 300)]
    sample_bytes: usize,
    /// The sample's prompt.
    #[arg(long, default_value = "fn main() {")]
    prompt: String,
    /// The sample's temperature (0: greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Stop once this many steps are done, the schedule still spanning --steps: with --save,
    /// a part of a run that --resume continues.
    #[arg(long, value_name = "N")]
    stop_after: Option<usize>,
    /// Data parallelism over N GPUs: start with `fp8-moe --gpus N train --dp N`. Each rank
    /// trains on its share of every step's batch (--batch x --microbatches sequences each);
    /// amaxes, gradients and the loss are reduced over NCCL inside the step (graph modes none
    /// and step).
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..))]
    dp: u64,
    /// Expert parallelism over N GPUs: start with `fp8-moe --gpus N train --ep N`. Each MoE
    /// layer's experts are split over the ranks (--experts a multiple of N, at least --top-k
    /// a rank), their tokens exchanged over NCCL inside the step; the rest of the model is
    /// data-parallel as with --dp (graph modes none and step). Checkpoints hold the whole
    /// model, as one GPU's.
    #[arg(long, value_name = "N", default_value_t = 1, conflicts_with = "dp",
          value_parser = clap::value_parser!(u64).range(1..))]
    ep: u64,
}

impl TrainArgs {
    /// The job these flags ask for (configurations checked when the model is built).
    fn job(&self) -> Result<train::job::JobConfig, String> {
        let (m, t) = (ModelConfig::default(), TrainConfig::default());
        let d_model = self.d_model.unwrap_or(m.d_model);
        let model = ModelConfig {
            d_model,
            heads: d_model / fp8_moe::model::config::HEAD_DIM,
            layers: self.layers.unwrap_or(m.layers),
            experts: self.experts.unwrap_or(m.experts),
            top_k: self.top_k.unwrap_or(m.top_k),
            ffn: self.ffn.unwrap_or(m.ffn),
            context: self.context.unwrap_or(m.context),
            batch: self.batch.unwrap_or(m.batch),
            ..m
        };
        let train = TrainConfig {
            microbatches: self.microbatches.unwrap_or(t.microbatches),
            lr: self.lr.unwrap_or(t.lr),
            warmup: self.warmup.unwrap_or(t.warmup),
            steps: self.steps.map_or(t.steps, |s| s as usize),
            weight_decay: self.weight_decay.unwrap_or(t.weight_decay),
            clip: self.clip.unwrap_or(t.clip),
            seed: self.seed.unwrap_or(t.seed),
            ..t
        };
        if self.resume.is_some() {
            let given = [
                ("--layers", self.layers.is_some()),
                ("--d-model", self.d_model.is_some()),
                ("--experts", self.experts.is_some()),
                ("--top-k", self.top_k.is_some()),
                ("--ffn", self.ffn.is_some()),
                ("--context", self.context.is_some()),
                ("--batch", self.batch.is_some()),
                ("--microbatches", self.microbatches.is_some()),
                ("--lr", self.lr.is_some()),
                ("--warmup", self.warmup.is_some()),
                ("--steps", self.steps.is_some()),
                ("--weight-decay", self.weight_decay.is_some()),
                ("--clip", self.clip.is_some()),
                ("--seed", self.seed.is_some()),
            ];
            let named: Vec<&str> = given.iter().filter(|g| g.1).map(|g| g.0).collect();
            if !named.is_empty() {
                return Err(format!(
                    "--resume continues the saved run with its own settings; drop {}",
                    named.join(", ")
                ));
            }
        }
        Ok(train::job::JobConfig {
            model,
            train,
            mode: self.graphs,
            data: self.data.clone(),
            save: self.save.clone(),
            resume: self.resume.clone(),
            report: self.report.clone(),
            eval_every: self.eval_every,
            eval_batches: 4,
            compare_steps: self.compare_steps,
            sample_bytes: self.sample_bytes,
            prompt: self.prompt.clone(),
            temperature: self.temperature,
            progress: !self.quiet,
            stop_after: self.stop_after,
            dp: self.dp as usize,
            ep: self.ep as usize,
        })
    }
}

/// The flags of `soak`.
#[derive(Debug, Args)]
struct SoakArgs {
    /// Replays of the measured phase, over the workloads (half each for `both`); a warmup
    /// of 3 x --check-every replays per workload (600 to 20000) comes first. The default
    /// takes a few minutes on an H200 (the MoE workload runs about 11,000 replays a second).
    #[arg(long, value_name = "N", default_value_t = 2_000_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    replays: u64,
    /// Compare with eager every N replays of each workload.
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..))]
    check_every: u64,
    /// Run an update event (whole-graph and per-node updates, then checked replays) every N
    /// replays.
    #[arg(long, value_name = "N", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(1..))]
    update_every: u64,
    /// Seeds the weights and every input.
    #[arg(long, value_name = "S", default_value_t = 1)]
    seed: u64,
    /// What to replay.
    #[arg(long, value_enum, default_value_t = soak::Workload::Both)]
    workload: soak::Workload,
    /// Stop the measured phase after this many seconds even short of --replays (the report
    /// says so).
    #[arg(long, value_name = "S", value_parser = positive_seconds)]
    max_seconds: Option<f64>,
    /// Where to write the report as JSON.
    #[arg(long, value_name = "PATH", default_value = "soak.json")]
    json: PathBuf,
}

/// A positive, finite number of seconds.
fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("'{s}' is not a positive number of seconds")),
    }
}

#[derive(Debug, Args)]
#[command(
    subcommand_value_name = "BENCH",
    subcommand_help_heading = "Benchmarks"
)]
struct BenchArgs {
    #[command(subcommand)]
    bench: Bench,
    /// Where to write the rows as JSON [default: bench-<name>.json].
    #[arg(long, value_name = "PATH", global = true)]
    json: Option<PathBuf>,
}

/// The benchmarks `bench` runs.
#[derive(Debug, Clone, Subcommand)]
enum Bench {
    /// Launch, replay, capture and update costs.
    Graph,
    /// FP8 quantize and cast-transpose bandwidth against a device copy.
    #[command(name = "fp8-cast")]
    Fp8Cast,
    /// FP8 GEMM and MoE grouped GEMM against cuBLASLt (loaded at run time).
    Gemm,
    /// Eager vs graphed step time of the FP8 MLP stack (16, 64 and 8192 tokens).
    Graphed,
    /// Tokens/s of the train job's default model in every graph mode (vs PyTorch's figures).
    Train,
    /// NCCL collectives eager and captured in graphs, the FP8 amax reduction's cost in a
    /// step graph, the train job's model data parallel against one GPU (run on every GPU
    /// with `fp8-moe --gpus N bench dist`).
    Dist,
    /// One training step of the dropless top-k SwiGLU MoE layer: eager, breaking-layer and
    /// full-layer graphs, beside the dense FP8 GEMM and PyTorch's figures.
    Moe {
        /// Only the shapes with this many tokens (256 or 4096).
        #[arg(long, value_name = "T")]
        tokens: Option<usize>,
        /// Only the shapes with this many experts (8 or 256).
        #[arg(long, value_name = "E")]
        experts: Option<usize>,
        /// Only these steps (repeat or separate with commas; all by default), e.g. to
        /// profile one of them.
        #[arg(long, value_name = "STEP", value_enum, value_delimiter = ',')]
        only: Vec<bench::moe::Step>,
        /// Run the full-layer steps' expert weight gradients beside their data gradients on
        /// this many SMs, or after them with 0 (`MoeLayer::with_weight_grads_beside`; the
        /// layer's default when not given).
        #[arg(long, value_name = "SMS")]
        weight_grads_beside: Option<usize>,
        /// Run the full-layer steps' dx and router weight gradient beside the expert weight
        /// gradients on this many SMs, or after them with 0
        /// (`MoeLayer::with_router_grads_beside`; the layer's default when not given).
        #[arg(long, value_name = "SMS")]
        router_grads_beside: Option<usize>,
    },
}

impl Bench {
    /// The name on the command line, which also names the default JSON file.
    fn name(&self) -> &'static str {
        match self {
            Bench::Graph => "graph",
            Bench::Fp8Cast => "fp8-cast",
            Bench::Gemm => "gemm",
            Bench::Graphed => "graphed",
            Bench::Moe { .. } => "moe",
            Bench::Train => "train",
            Bench::Dist => "dist",
        }
    }
}

/// Parses the command line. `--help` and `--version` print to stdout and exit 0; a usage error
/// prints clap's error and the usage to stderr and exits 2. clap leaves the usage out of a few
/// errors (`--json` without a path, for one); those get the usage of the deepest subcommand
/// named on the command line.
fn parse_args() -> Cli {
    Cli::try_parse().unwrap_or_else(|mut e| {
        if e.use_stderr()
            && e.kind() != ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            && e.get(ContextKind::Usage).is_none()
        {
            let mut cmd = Cli::command();
            cmd.build();
            let mut sub = &cmd;
            for arg in std::env::args_os().skip(1) {
                if let Some(next) = arg.to_str().and_then(|a| sub.find_subcommand(a)) {
                    sub = next;
                }
            }
            let usage = sub.clone().render_usage();
            e.insert(ContextKind::Usage, ContextValue::StyledStr(usage));
        }
        e.exit()
    })
}

fn main() -> ExitCode {
    let cli = parse_args();
    if let Some(gpus) = cli.launch.gpus {
        return exit(launch(&cli.launch, gpus.get(), &cli.command));
    }
    let result = match cli.command {
        Command::Info => info::run(&mut std::io::stdout().lock()),
        Command::Bench(BenchArgs { bench, json }) => {
            let json = json.unwrap_or_else(|| format!("bench-{}.json", bench.name()).into());
            run_bench(&bench, &json)
        }
        Command::Soak(args) => run_soak(args),
        Command::Train(args) => args
            .job()
            .and_then(|job| train::job::run(&job).map(|_| ()))
            .map_err(info::CliError::Other),
    };
    exit(result)
}

/// The exit code of a command's result; an error is printed as one line.
fn exit(result: Result<(), info::CliError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fp8-moe: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_bench(bench: &Bench, json_path: &std::path::Path) -> Result<(), info::CliError> {
    let (title, rows) = match bench {
        Bench::Graph => (
            "bench graph: chain of 1000 x add 1.0 to 1024 floats (4 x 256)",
            bench::graph::run(),
        ),
        Bench::Fp8Cast => (
            "bench fp8-cast: memory-bound FP8 kernels against a device copy",
            bench::fp8_cast::run(),
        ),
        Bench::Gemm => (
            "bench gemm: FP8 GEMM (M x N x K) against cuBLASLt in the same run",
            bench::gemm::run(),
        ),
        Bench::Graphed => (
            "bench graphed: eager vs graphed step time (FP8 MLP stack)",
            bench::graphed::run(),
        ),
        Bench::Train => (
            "bench train: the train job's default model, tokens/s per graph mode (same run)",
            bench::train::run(),
        ),
        Bench::Dist => (
            "bench dist: NCCL collectives, eager and captured in CUDA graphs",
            bench::dist::run(),
        ),
        Bench::Moe {
            tokens,
            experts,
            only,
            weight_grads_beside,
            router_grads_beside,
        } => (
            "bench moe: MoE layer training step (forward + backward), eager vs graphs",
            bench::moe::run(
                *tokens,
                *experts,
                only,
                bench::moe::Beside {
                    weight_grads: *weight_grads_beside,
                    router_grads: *router_grads_beside,
                },
            ),
        ),
    };
    let rows = rows.map_err(|e| info::CliError::Other(e.to_string()))?;
    // In a multi-process job every rank runs the benchmark; rank 0 reports it.
    if std::env::var("RANK").is_ok_and(|r| r.trim() != "0") {
        return Ok(());
    }
    print!("{}", bench::table(title, &rows));
    let file = std::fs::File::create(json_path)?;
    bench::write_json(&mut std::io::BufWriter::new(file), bench.name(), &rows)?;
    println!("wrote {}", json_path.display());
    Ok(())
}

fn run_soak(args: SoakArgs) -> Result<(), info::CliError> {
    let cfg = soak::SoakConfig {
        replays: args.replays,
        check_every: args.check_every,
        update_every: args.update_every,
        seed: args.seed,
        workload: args.workload,
        max_seconds: args.max_seconds,
    };
    let report = soak::run(&cfg, &mut std::io::stdout().lock())
        .map_err(|e| info::CliError::Other(e.to_string()))?;
    let title = format!(
        "soak: {} replays (seed {}), checked against eager every {}, updates every {}{}",
        report.replays,
        cfg.seed,
        cfg.check_every,
        cfg.update_every,
        if report.stopped_early {
            " (stopped early by --max-seconds)"
        } else {
            ""
        }
    );
    print!("{}", bench::table(&title, &report.rows));
    let file = std::fs::File::create(&args.json)?;
    let mut out = std::io::BufWriter::new(file);
    serde_json::to_writer(&mut out, &report).map_err(std::io::Error::from)?;
    std::io::Write::write_all(&mut out, b"\n")?;
    std::io::Write::flush(&mut out)?;
    println!("wrote {}", args.json.display());
    match report.failure() {
        Some(line) => Err(info::CliError::Other(line)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn launch_flags_are_kept_from_the_children() {
        let os = |v: &[&str]| -> Vec<std::ffi::OsString> { v.iter().map(Into::into).collect() };
        let args = os(&[
            "--gpus",
            "2",
            "--master-port=29500",
            "--nnodes",
            "1",
            "bench",
            "dist",
            "--json",
            "x.json",
            "--gpus",
            "kept",
        ]);
        assert_eq!(
            strip_launch_flags(&args),
            os(&["bench", "dist", "--json", "x.json", "--gpus", "kept"])
        );
        let cli = Cli::try_parse_from(["fp8-moe", "--gpus", "2", "bench", "dist"]).unwrap();
        assert_eq!(cli.launch.gpus.map(|g| g.get()), Some(2));
        assert!(Cli::try_parse_from(["fp8-moe", "--gpus", "0", "bench", "dist"]).is_err());
        // The multi-node flags need --gpus.
        assert!(Cli::try_parse_from(["fp8-moe", "--nnodes", "2", "bench", "dist"]).is_err());
    }

    #[test]
    fn bench_json_defaults_to_none_and_takes_a_path() {
        let cli = Cli::try_parse_from(["fp8-moe", "bench", "fp8-cast"]).unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("not bench: {cli:?}")
        };
        assert!(matches!(args.bench, Bench::Fp8Cast));
        assert_eq!(args.json, None);
        let cli = Cli::try_parse_from(["fp8-moe", "bench", "gemm", "--json", "x.json"]).unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("not bench: {cli:?}")
        };
        assert!(matches!(args.bench, Bench::Gemm));
        assert_eq!(args.json, Some(PathBuf::from("x.json")));
    }

    #[test]
    fn subcommand_names_match_bench_names() {
        for bench in [
            Bench::Graph,
            Bench::Fp8Cast,
            Bench::Gemm,
            Bench::Graphed,
            Bench::Train,
            Bench::Moe {
                tokens: None,
                experts: None,
                only: Vec::new(),
                weight_grads_beside: None,
                router_grads_beside: None,
            },
        ] {
            let cli = Cli::try_parse_from(["fp8-moe", "bench", bench.name()]).unwrap();
            let Command::Bench(args) = cli.command else {
                panic!("not bench: {cli:?}")
            };
            assert_eq!(args.bench.name(), bench.name());
        }
    }

    #[test]
    fn moe_bench_takes_shape_filters() {
        let cli = Cli::try_parse_from(["fp8-moe", "bench", "moe", "--tokens", "4096"]).unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("not bench: {cli:?}")
        };
        assert!(matches!(
            args.bench,
            Bench::Moe {
                tokens: Some(4096),
                experts: None,
                ref only,
                weight_grads_beside: None,
                router_grads_beside: None,
            } if only.is_empty()
        ));
        let cli = Cli::try_parse_from([
            "fp8-moe",
            "bench",
            "moe",
            "--weight-grads-beside",
            "66",
            "--router-grads-beside",
            "0",
        ])
        .unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("not bench: {cli:?}")
        };
        assert!(matches!(
            args.bench,
            Bench::Moe {
                weight_grads_beside: Some(66),
                router_grads_beside: Some(0),
                ..
            }
        ));
        assert!(Cli::try_parse_from(["fp8-moe", "bench", "moe", "--experts", "x"]).is_err());
        let cli =
            Cli::try_parse_from(["fp8-moe", "bench", "moe", "--only", "fp8-weights-bf16,full"])
                .unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("not bench: {cli:?}")
        };
        let Bench::Moe { only, .. } = args.bench else {
            panic!("not moe: {args:?}")
        };
        use bench::moe::Step;
        assert_eq!(only, [Step::Fp8WeightsBf16, Step::Full]);
        assert!(Cli::try_parse_from(["fp8-moe", "bench", "moe", "--only", "fastest"]).is_err());
    }
}
