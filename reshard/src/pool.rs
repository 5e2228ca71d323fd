//! Weights in the kvfs pool: stored once under one placement, loaded by any other.
//!
//! [`store`] puts one replica of every tensor (the lowest-numbered) as one object per fragment,
//! `reshard/<model>/t/<tensor>/<offsets>` (the fragment's global offset, so keys name boxes,
//! not list positions), checksummed and soft-pinned; [`store_manifest`] puts the stored
//! placement, `reshard/<model>/manifest`, once every fragment is in (a loader that finds the
//! manifest finds every fragment). Objects are immutable: storing a model name twice keeps the
//! first value, and a manifest that differs from the stored one is a [`ErrorKind::Mismatch`].
//!
//! [`load`] plans from the stored placement to the caller's, fetches the stored fragments its
//! participant's regions read (each once, in one batch) and copies the regions into the
//! caller's buffers. It fetches whole fragments: a target that needs a thin slice of a large
//! stored fragment moves the whole fragment (the pool has no ranged get).

use std::collections::BTreeMap;

use kvfs_client::{Client, Pin, PutOptions};

use crate::placement::{Fragment, Placement, TensorPlacement};
use crate::plan::{Limits, plan};
use crate::{Error, ErrorKind, Result};

/// The placement as stored: each tensor's lowest replica, renumbered replica 0.
pub fn stored_placement(p: &Placement) -> Placement {
    let tensors = p
        .tensors
        .iter()
        .map(|t| {
            let first = t.fragments.iter().map(|f| f.replica).min().unwrap_or(0);
            TensorPlacement {
                desc: t.desc.clone(),
                fragments: t
                    .fragments
                    .iter()
                    .filter(|f| f.replica == first)
                    .map(|f| Fragment { replica: 0, ..f.clone() })
                    .collect(),
            }
        })
        .collect();
    Placement { participants: p.participants, tensors }
}

fn check_model(model: &str) -> Result<()> {
    if model.is_empty() || model.len() > 200 || model.contains(['/', '\0']) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "pool",
            format!("model name {model:?} (1..=200 bytes, no '/')"),
        ));
    }
    Ok(())
}

pub fn manifest_key(model: &str) -> String {
    format!("reshard/{model}/manifest")
}

pub fn fragment_key(model: &str, tensor: &str, f: &Fragment) -> String {
    let off: Vec<String> = f.offset.iter().map(u64::to_string).collect();
    format!("reshard/{model}/t/{tensor}/{}", off.join("_"))
}

fn put_options() -> PutOptions {
    PutOptions { checksum: true, pin: Pin::Soft, ..PutOptions::default() }
}

/// Stores the fragments in `items` ((tensor index, fragment index, bytes) of `placement`) that
/// belong to the stored replica; returns how many it stored. Every participant of the stored
/// replica calls it with its own fragments (or one process with all of them).
pub async fn store(
    client: &Client,
    model: &str,
    placement: &Placement,
    items: &[(u32, u32, &[u8])],
) -> Result<usize> {
    check_model(model)?;
    placement.validate()?;
    let mut puts: Vec<(String, &[u8])> = Vec::new();
    for &(ti, fi, bytes) in items {
        let t = placement.tensors.get(ti as usize).ok_or_else(|| {
            Error::new(ErrorKind::InvalidArgument, "store", format!("tensor index {ti}"))
        })?;
        let f = t.fragments.get(fi as usize).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                "store",
                format!("{} fragment {fi}", t.desc.name),
            )
        })?;
        let want = f.elements() * t.desc.itemsize as u64;
        if bytes.len() as u64 != want {
            return Err(Error::new(
                ErrorKind::Mismatch,
                "store",
                format!(
                    "{} fragment {fi}: {} bytes, the placement says {want}",
                    t.desc.name,
                    bytes.len()
                ),
            ));
        }
        let first = t.fragments.iter().map(|f| f.replica).min().unwrap_or(0);
        if f.replica == first {
            puts.push((fragment_key(model, &t.desc.name, f), bytes));
        }
    }
    let refs: Vec<(&str, &[u8])> = puts.iter().map(|(k, b)| (k.as_str(), *b)).collect();
    for (r, (k, _)) in client.put_batch(&refs, &put_options()).await.into_iter().zip(&puts) {
        r.map_err(|e| Error::new(ErrorKind::Store, "store", format!("{k}: {e}")))?;
    }
    Ok(puts.len())
}

/// Puts the manifest of `placement` under `model` (after every fragment is stored).
pub async fn store_manifest(client: &Client, model: &str, placement: &Placement) -> Result<()> {
    check_model(model)?;
    placement.validate()?;
    let json = stored_placement(placement).to_json();
    let key = manifest_key(model);
    client
        .put(&key, json.as_bytes(), &put_options())
        .await
        .map_err(|e| Error::store("store manifest", e))?;
    let back = manifest(client, model).await?;
    if back.to_json() != json {
        return Err(Error::new(
            ErrorKind::Mismatch,
            "store manifest",
            format!("{model} is already stored under another placement ({})", back.digest()),
        ));
    }
    Ok(())
}

/// The stored placement of `model`.
pub async fn manifest(client: &Client, model: &str) -> Result<Placement> {
    check_model(model)?;
    let b = client.get(&manifest_key(model)).await.map_err(|e| Error::store("manifest", e))?;
    let s = std::str::from_utf8(&b)
        .map_err(|e| Error::new(ErrorKind::Mismatch, "manifest", e.to_string()))?;
    Placement::from_json(s)
}

/// Loads `participant`'s fragments of `target` from the stored `model`: (tensor index, fragment
/// index, bytes) in the target's order.
pub async fn load(
    client: &Client,
    model: &str,
    target: &Placement,
    participant: u32,
) -> Result<Vec<(u32, u32, Vec<u8>)>> {
    let stored = manifest(client, model).await?;
    let p = plan(&stored, target, &Limits::default())?;
    let mut out: BTreeMap<(u32, u32), Vec<u8>> = BTreeMap::new();
    for (ti, t) in target.tensors.iter().enumerate() {
        for (fi, f) in t.fragments.iter().enumerate() {
            if f.participant == participant {
                out.insert(
                    (ti as u32, fi as u32),
                    vec![0; (f.elements() * t.desc.itemsize as u64) as usize],
                );
            }
        }
    }
    // The stored fragments these regions read, each fetched once.
    let mut need: BTreeMap<(String, u32), usize> = BTreeMap::new();
    let mut keys = Vec::new();
    let regions: Vec<_> = p.regions.iter().filter(|r| r.dst_participant == participant).collect();
    for r in &regions {
        let name = &target.tensors[r.tensor as usize].desc.name;
        let sk = (name.clone(), r.src_fragment);
        if let std::collections::btree_map::Entry::Vacant(v) = need.entry(sk) {
            let st = &stored.tensors[r.src_tensor as usize];
            v.insert(keys.len());
            keys.push(fragment_key(model, name, &st.fragments[r.src_fragment as usize]));
        }
    }
    let got = client.get_batch(&keys).await;
    let mut bufs = Vec::with_capacity(got.len());
    for (r, k) in got.into_iter().zip(&keys) {
        bufs.push(r.map_err(|e| Error::store("load", e).with_detail(k))?);
    }
    for r in regions {
        let t = &target.tensors[r.tensor as usize];
        let st = &stored.tensors[r.src_tensor as usize];
        let src = &bufs[need[&(t.desc.name.clone(), r.src_fragment)]];
        let want = st.fragments[r.src_fragment as usize].elements() * t.desc.itemsize as u64;
        if src.len() as u64 != want {
            return Err(Error::new(
                ErrorKind::Mismatch,
                "load",
                format!(
                    "{}: a stored fragment of {} bytes, the manifest says {want}",
                    t.desc.name,
                    src.len()
                ),
            ));
        }
        let dst = out.get_mut(&(r.tensor, r.dst_fragment)).expect("target fragment");
        r.for_each_segment(|s, d, len| {
            let (s, d, len) = (s as usize, d as usize, len as usize);
            dst[d..d + len].copy_from_slice(&src[s..s + len]);
        });
    }
    Ok(out.into_iter().map(|((t, f), b)| (t, f, b)).collect())
}
