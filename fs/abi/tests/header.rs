//! The C header and the Rust crate describe the same ABI: gcc compiles a program against
//! `include/kvfs.h` that prints every size, offset and ioctl number, and they must match.

use std::path::PathBuf;
use std::process::Command;

use kvfs_fs_abi::*;

const PROGRAM: &str = r#"
#include <stddef.h>
#include <stdio.h>
#include "kvfs.h"
#define F(s, f) printf(#s "." #f " %zu\n", offsetof(struct s, f))
#define S(s) printf(#s " %zu\n", sizeof(struct s))
int main(void) {
    printf("version %u\n", KVFS_ABI_VERSION);
    printf("get %u\nput %u\n", KVFS_OP_GET, KVFS_OP_PUT);
    printf("IOC_INFO %lu\n", (unsigned long)KVFS_IOC_INFO);
    printf("IOC_REGISTER %lu\n", (unsigned long)KVFS_IOC_REGISTER);
    printf("IOC_UNREGISTER %lu\n", (unsigned long)KVFS_IOC_UNREGISTER);
    printf("IOC_SUBMIT %lu\n", (unsigned long)KVFS_IOC_SUBMIT);
    S(kvfs_info); S(kvfs_register); S(kvfs_unregister); S(kvfs_submit); S(kvfs_item);
    F(kvfs_register, fd); F(kvfs_register, len); F(kvfs_register, buffer_id);
    F(kvfs_submit, items_offset); F(kvfs_submit, count); F(kvfs_submit, ok);
    F(kvfs_submit, failed);
    F(kvfs_item, key_len); F(kvfs_item, data_offset); F(kvfs_item, data_len);
    F(kvfs_item, size); F(kvfs_item, status);
    return 0;
}
"#;

#[test]
fn header_matches_the_crate() {
    let dir = tempfile_dir();
    let src = dir.join("abi.c");
    let bin = dir.join("abi");
    std::fs::write(&src, PROGRAM).unwrap();
    let include = manifest_dir().join("include");
    let out = Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .arg("-I")
        .arg(&include)
        .output()
        .expect("gcc must be installed (it is on the project's machines)");
    assert!(out.status.success(), "gcc failed: {}", String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&bin).output().unwrap();
    assert!(run.status.success());
    let text = String::from_utf8(run.stdout).unwrap();
    let got: std::collections::HashMap<&str, u64> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let want: &[(&str, u64)] = &[
        ("version", ABI_VERSION as u64),
        ("get", OP_GET as u64),
        ("put", OP_PUT as u64),
        ("IOC_INFO", IOC_INFO as u64),
        ("IOC_REGISTER", IOC_REGISTER as u64),
        ("IOC_UNREGISTER", IOC_UNREGISTER as u64),
        ("IOC_SUBMIT", IOC_SUBMIT as u64),
        ("kvfs_info", Info::SIZE as u64),
        ("kvfs_register", Register::SIZE as u64),
        ("kvfs_unregister", Unregister::SIZE as u64),
        ("kvfs_submit", Submit::SIZE as u64),
        ("kvfs_item", Item::SIZE as u64),
        ("kvfs_register.fd", 4),
        ("kvfs_register.len", 8),
        ("kvfs_register.buffer_id", 24),
        ("kvfs_submit.items_offset", 16),
        ("kvfs_submit.count", 24),
        ("kvfs_submit.ok", 32),
        ("kvfs_submit.failed", 36),
        ("kvfs_item.key_len", 8),
        ("kvfs_item.data_offset", 16),
        ("kvfs_item.data_len", 24),
        ("kvfs_item.size", Item::SIZE_OFFSET as u64),
        ("kvfs_item.status", Item::STATUS_OFFSET as u64),
    ];
    for (k, v) in want {
        assert_eq!(got.get(k), Some(v), "{k}: header says {:?}, crate says {v}", got.get(k));
    }
    // The Rust encoding puts each field at the C offset.
    let r = Register { fd: -5, buffer_id: 0xabcdef, ..Default::default() }.to_bytes();
    assert_eq!(i32::from_ne_bytes(r[4..8].try_into().unwrap()), -5);
    assert_eq!(u64::from_ne_bytes(r[24..32].try_into().unwrap()), 0xabcdef);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvfs-abi-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The crate's source folder as the test runner reports it now (cargo and nextest set it when
/// they run a test), so a test binary built from another checkout still finds this one's files.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}
