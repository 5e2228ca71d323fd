//! One participant of a multi-process reshard; see `kvfs_reshard::rank`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(kvfs_reshard::rank::main(&args));
}
