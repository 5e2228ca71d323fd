//! `kvfs nvmeof attach|detach`: a remote NVMe namespace over NVMe/TCP, connected and mounted
//! (or unmounted and disconnected) by the same code a node's `--nvmeof` tier uses
//! (`kvfs_tiers::nvmeof`), for an operator who prepares a namespace (`format`) or points a
//! benchmark or test at it; the attachment outlives the command until `detach`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use kvfs_tiers::{NvmeofAttachment, NvmeofSpec, nvmeof};

use super::cluster::parse_nvmeof;

#[derive(Subcommand)]
pub enum NvmeofCmd {
    /// Connect the namespace and mount its ext4 file system at --mount (root, nvme-tcp module);
    /// `format` in SPEC makes the file system on a blank namespace. It stays attached.
    Attach(NvmeofArgs),
    /// Unmount --mount if it is the namespace's mount, and disconnect the subsystem's
    /// controller at that address (nothing attached: nothing to do, not an error).
    Detach(NvmeofArgs),
}

#[derive(Args)]
pub struct NvmeofArgs {
    /// transport=tcp,traddr=IP,trsvcid=PORT,nqn=NQN[,nsid=N][,format][,...] (as `kvfs node
    /// --nvmeof`).
    #[arg(value_parser = parse_nvmeof)]
    spec: NvmeofSpec,
    /// The directory the namespace's file system is (to be) mounted on.
    #[arg(long)]
    mount: PathBuf,
}

pub async fn run(cmd: NvmeofCmd) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || match cmd {
        NvmeofCmd::Attach(a) => {
            // The error names the spec and the step already.
            let att = NvmeofAttachment::attach(&a.spec, &a.mount)?;
            let cap = att.capacity_bytes()?;
            println!(
                "attached {} as {} (controller {}), mounted at {} ({} usable by an NVMe tier)",
                a.spec,
                att.device().display(),
                att.controller(),
                att.dir().display(),
                crate::bench::report::human_bytes(cap)
            );
            att.leave();
            Ok(())
        }
        NvmeofCmd::Detach(a) => {
            let r = nvmeof::detach_existing(&a.spec, &a.mount)
                .with_context(|| format!("detaching {}", a.spec))?;
            match (r.unmounted, r.disconnected.is_empty()) {
                (false, true) => println!("{} was not attached: nothing to do", a.spec),
                _ => println!(
                    "detached {}: {}unmounted, disconnected {}",
                    a.spec,
                    if r.unmounted { "" } else { "not " },
                    if r.disconnected.is_empty() {
                        "nothing".into()
                    } else {
                        r.disconnected.join(", ")
                    }
                ),
            }
            Ok(())
        }
    })
    .await?
}
