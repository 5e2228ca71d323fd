//! The conductor's vLLM block hashes against Python's, byte for byte.
//!
//! Random cases from a fixed seed go to `tests/vllm_hash.py`, run by `$KVFS_VENV/bin/python`
//! (default `/opt/kvfs-venv`), which hashes them with a transcription of vLLM's code and, where
//! vLLM is installed (e.g. `KVFS_VENV=/opt/kvfs-engines-venv`), with vLLM itself. A missing
//! interpreter or module fails the test; `KVFS_SKIP_PY_TESTS=1` opts out explicitly, and
//! `KVFS_REQUIRE_VLLM=1` additionally fails unless vLLM checked every case.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use kvfs_conductor::hash::{
    Algorithm, BlockHasher, EventHash, Extra, HashError, HashProfile, LoraKey, event_hash_to_u64,
    project_low64_be,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

struct Case {
    profile: HashProfile,
    block_size: usize,
    tokens: Vec<u32>,
    extra: Extra,
}

impl Case {
    fn to_json(&self) -> Value {
        json!({
            "algorithm": self.profile.algorithm.name(),
            "seed": self.profile.python_hash_seed,
            "block_size": self.block_size,
            "tokens": self.tokens,
            "lora": self.extra.lora.as_ref().map(|l| json!({"name": l.name, "path": l.path})),
            "cache_salt": self.extra.cache_salt,
        })
    }
}

const ALGORITHMS: [Algorithm; 4] =
    [Algorithm::Sha256, Algorithm::Sha256Cbor, Algorithm::Xxhash, Algorithm::XxhashCbor];

fn token(rng: &mut StdRng) -> u32 {
    // Every pickle int opcode: BININT1, BININT2, BININT and LONG1.
    match rng.random_range(0..4) {
        0 => rng.random_range(0..256),
        1 => rng.random_range(256..65_536),
        2 => rng.random_range(65_536..0x8000_0000),
        _ => rng.random_range(0x8000_0000..=u32::MAX),
    }
}

fn string(rng: &mut StdRng) -> String {
    // One-character Latin-1 strings and "" are shared objects in CPython (pickle memo).
    let pool = ["a", "é", "", "ő", "adapter-7", "/models/lora/sql", "日本語", "ab"];
    pool[rng.random_range(0..pool.len())].to_owned()
}

fn random_case(rng: &mut StdRng) -> Case {
    let algorithm = ALGORITHMS[rng.random_range(0..ALGORITHMS.len())];
    let seeds = [None, Some("0"), Some("42"), Some(""), Some("vllm-none-hash")];
    let mut seed = seeds[rng.random_range(0..seeds.len())].map(str::to_owned);
    if seed.is_none() && !algorithm.is_cryptographic() {
        seed = Some("1234".to_owned());
    }
    let block_size = [1, 16, 512][rng.random_range(0..3)];
    let len = rng.random_range(0..=3 * block_size + block_size / 2 + 1);
    let lora = rng.random_bool(0.4).then(|| {
        let name = string(rng);
        let path = if rng.random_bool(0.3) { name.clone() } else { string(rng) };
        // vLLM asserts lora_path is non-empty.
        LoraKey { name, path: if path.is_empty() { "p".to_owned() } else { path } }
    });
    let cache_salt = rng.random_bool(0.4).then(|| string(rng));
    Case {
        profile: HashProfile { algorithm, python_hash_seed: seed },
        block_size,
        tokens: (0..len).map(|_| token(rng)).collect(),
        extra: Extra { lora, cache_salt },
    }
}

/// Pickles over 64 KiB: several protocol-5 frames, and a salt written outside any frame.
fn large_cases(rng: &mut StdRng) -> Vec<Case> {
    let big =
        |algorithm, block_size: usize, blocks: usize, salt: Option<String>, rng: &mut StdRng| {
            Case {
                profile: HashProfile { algorithm, python_hash_seed: Some("7".to_owned()) },
                block_size,
                tokens: (0..block_size * blocks + 3).map(|_| token(rng)).collect(),
                extra: Extra {
                    lora: Some(LoraKey { name: "a".to_owned(), path: "a".to_owned() }),
                    cache_salt: salt,
                },
            }
        };
    vec![
        big(Algorithm::Sha256, 30_000, 2, None, rng),
        big(Algorithm::Xxhash, 9_400, 2, Some("x".repeat(70_000)), rng),
        big(Algorithm::Sha256Cbor, 20_000, 1, Some("é".repeat(40_000)), rng),
    ]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn run_python(cases: &[Case]) -> Value {
    let venv = std::env::var("KVFS_VENV").unwrap_or_else(|_| "/opt/kvfs-venv".to_owned());
    let python = PathBuf::from(&venv).join("bin/python");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vllm_hash.py");
    let mut child = Command::new(&python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}); set KVFS_VENV to a venv with cbor2 and xxhash, \
                 or KVFS_SKIP_PY_TESTS=1 to skip",
                python.display()
            )
        });
    let input = json!({ "cases": cases.iter().map(Case::to_json).collect::<Vec<_>>() });
    let mut stdin = child.stdin.take().expect("piped stdin");
    let writer = std::thread::spawn(move || stdin.write_all(input.to_string().as_bytes()));
    let output = child.wait_with_output().expect("wait for python");
    // A script that exits early breaks the pipe: report its stderr rather than the write error.
    let written = writer.join().expect("writer thread");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} {} failed ({}):\n{stderr}",
        python.display(),
        script.display(),
        output.status
    );
    written.expect("write cases to python");
    serde_json::from_slice(&output.stdout).expect("python prints JSON")
}

#[test]
fn block_hashes_equal_vllm_byte_for_byte() {
    if std::env::var("KVFS_SKIP_PY_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("KVFS_SKIP_PY_TESTS=1: not comparing block hashes with Python");
        return;
    }
    let mut rng = StdRng::seed_from_u64(0x6b76_6673);
    let mut cases: Vec<Case> = (0..80).map(|_| random_case(&mut rng)).collect();
    cases.extend(large_cases(&mut rng));

    let reply = run_python(&cases);
    let results = reply["results"].as_array().expect("results array");
    assert_eq!(results.len(), cases.len());
    let mut blocks = 0;
    for (i, (case, want)) in cases.iter().zip(results).enumerate() {
        let hasher = BlockHasher::new(&case.profile).expect("reproducible profile");
        assert_eq!(hex(hasher.root()), want["root"].as_str().expect("root"), "case {i}: root");
        let got = hasher.block_hashes(&case.tokens, case.block_size, &case.extra).expect("hashes");
        let want_hex: Vec<&str> =
            want["digests"].as_array().expect("digests").iter().filter_map(Value::as_str).collect();
        let got_hex: Vec<String> = got.iter().map(|d| hex(d)).collect();
        assert_eq!(got_hex, want_hex, "case {i}: {:?} bs {}", case.profile, case.block_size);
        assert_eq!(got.len(), case.tokens.len() / case.block_size, "case {i}: full blocks only");
        let want_low: Vec<u64> =
            want["low64"].as_array().expect("low64").iter().filter_map(Value::as_u64).collect();
        let got_low: Vec<u64> = got.iter().map(|d| project_low64_be(d)).collect();
        assert_eq!(got_low, want_low, "case {i}: event ints");
        for (d, &low) in got.iter().zip(&want_low) {
            assert_eq!(event_hash_to_u64(EventHash::Bytes(d)), Ok(low));
        }
        // The lazy form yields the same chain and can stop early.
        let first: Vec<_> = hasher
            .iter(&case.tokens, case.block_size, &case.extra)
            .expect("iter")
            .take(2)
            .collect();
        assert_eq!(first[..], got[..got.len().min(2)]);
        blocks += got.len();
    }
    let checked = reply["vllm_checked"].as_u64().unwrap_or(0);
    eprintln!("{} cases, {blocks} blocks equal; {checked} also checked against vLLM", cases.len());
    if std::env::var("KVFS_REQUIRE_VLLM").is_ok_and(|v| v == "1") {
        assert_eq!(
            checked,
            cases.len() as u64,
            "KVFS_REQUIRE_VLLM=1 but vLLM did not check every case"
        );
    }
}

#[test]
fn xxhash_without_seed_is_not_reproducible() {
    for algorithm in [Algorithm::Xxhash, Algorithm::XxhashCbor] {
        let profile = HashProfile { algorithm, python_hash_seed: None };
        assert_eq!(BlockHasher::new(&profile), Err(HashError::SeedRequired(algorithm)));
    }
}
