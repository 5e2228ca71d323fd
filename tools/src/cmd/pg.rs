//! `kvfs pg coordinator`: a process group's coordinator in a process of its own, so the group
//! keeps changing membership whichever rank fails (otherwise rank 0 hosts it).

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfs_pg::{Coordinator, CoordinatorConfig};

#[derive(Args)]
pub struct CoordinatorArgs {
    /// Address members reach the coordinator at (what they pass as the coordinator).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Group name members must present.
    #[arg(long, default_value = "default")]
    pub group: String,
    /// Slots of the initial group: it forms when slots 0..WORLD have joined.
    #[arg(long)]
    pub world: u32,
    /// Most slots the group may ever address (joiners above WORLD up to this).
    #[arg(long, default_value_t = kvfs_pg::GROUP_SIZE_LIMIT)]
    pub max_group_size: u32,
    /// How often every active member is pinged.
    #[arg(long, default_value_t = 200)]
    pub heartbeat_ms: u64,
    /// A member silent this long is removed (a dead process is removed at once).
    #[arg(long, default_value_t = 3000)]
    pub failure_timeout_ms: u64,
}

pub async fn coordinator(a: CoordinatorArgs) -> anyhow::Result<()> {
    let mut cfg = CoordinatorConfig::new(&a.group, a.world);
    cfg.listen = a.listen.parse().with_context(|| format!("--listen {}", a.listen))?;
    cfg.max_group_size = a.max_group_size;
    cfg.heartbeat_ms = a.heartbeat_ms;
    cfg.failure_timeout_ms = a.failure_timeout_ms;
    cfg.reconcile_timeout_ms = a.failure_timeout_ms * 2;
    let c = Coordinator::start(cfg).await?;
    println!("{}", c.addr());
    eprintln!("kvfs pg coordinator for group {:?} ({} slots) at {}", a.group, a.world, c.addr());
    let mut last = 0;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                let v = c.view();
                if v.epoch != last {
                    last = v.epoch;
                    eprintln!("epoch {}: active {:?} (world {}), waiting {:?}", v.epoch, v.slots(), v.world, c.pending());
                }
            }
        }
    }
}
