//! Run the store's seeded simulation over many seeds:
//! `./dev sim [SEEDS] [--start S] [--ops N] [--threads T] [--no-faults]`.
//! A failing seed is printed; `--start SEED 1` replays it.

use ssdtier_core::sim::{run, Workload};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut seeds, mut start, mut ops, mut threads, mut faults) = (1000u64, 0u64, 300usize, 1usize, true);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> u64 {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{what} needs a number"))
        };
        match a.as_str() {
            "--start" => start = num("--start"),
            "--ops" => ops = num("--ops") as usize,
            "--threads" => threads = num("--threads") as usize,
            "--no-faults" => faults = false,
            n => seeds = n.parse().unwrap_or_else(|_| panic!("unknown argument {n:?}")),
        }
    }
    let t0 = Instant::now();
    let (mut total_ops, mut bytes, mut failed_stores, mut errors, mut external) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for seed in start..start + seeds {
        let w = Workload { seed, ops, threads, faults };
        match run(&w) {
            Ok(o) => {
                total_ops += o.ops;
                bytes += o.bytes_checked;
                errors += o.errors_allowed;
                external += o.external;
                failed_stores += o.store_failed as u64;
            }
            Err(e) => {
                eprintln!("seed {seed} failed ({w:?}): {e}");
                eprintln!(
                    "replay: ./dev sim 1 --start {seed} --ops {ops} --threads {threads}{}",
                    if faults { "" } else { " --no-faults" }
                );
                std::process::exit(1);
            }
        }
        if (seed - start + 1) % 10_000 == 0 {
            eprintln!("{} seeds ...", seed - start + 1);
        }
    }
    println!(
        "{seeds} seeds from {start}: {total_ops} ops ({external} external transfers), {:.1} MB checked byte for byte, \
         {errors} injected errors seen, {failed_stores} runs with a failed ring; {:.1} s",
        bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
}
