//! The seeded simulation in CI: a few hundred seeds on one thread (each replays exactly),
//! some without faults, and a few dozen with threads racing. `./dev sim N` runs more.

use ssdtier_core::sim::{run, Workload};

fn seeds(from: u64, n: u64, ops: usize, threads: usize, faults: bool) {
    for seed in from..from + n {
        let w = Workload { seed, ops, threads, faults };
        if let Err(e) = run(&w) {
            panic!(
                "seed {seed} failed: {e}\nreplay: ./dev sim 1 --start {seed} --ops {ops} --threads {threads}{}",
                if faults { "" } else { " --no-faults" }
            );
        }
    }
}

#[test]
fn seeds_with_faults() {
    seeds(0, 300, 200, 1, true);
}

#[test]
fn seeds_without_faults() {
    seeds(10_000, 100, 200, 1, false);
}

#[test]
fn seeds_with_threads_racing() {
    seeds(20_000, 30, 150, 4, true);
}
