//! Writes the fuzz seed corpus: one valid batch per lane, plus the malformed corpus's
//! shapes (truncated, bad magic, bad version, bit flip, summary mismatch, short entry).
//!
//! `cargo run -p proto-flat --example fuzz_seeds -- proto-flat/fuzz/corpus/batch`

use std::path::PathBuf;

use proto_flat::batch::reseal;
use proto_flat::codes::Class;
use proto_flat::sample;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: fuzz_seeds DIR")?);
    std::fs::create_dir_all(&dir)?;
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    for (name, lane) in [("p0", Class::P0), ("p1", Class::P1), ("p2", Class::P2)] {
        let b = sample::batch(lane, 1, &sample::frames_for_lane(lane, 100))?;
        seeds.push((format!("valid_{name}"), b.clone()));
        seeds.push((format!("frames_only_{name}"), b[152..b.len() - 48].to_vec()));
    }
    let valid = seeds[2].1.clone(); // the P1 batch: every sectioned kind
    seeds.push(("truncated".into(), valid[..valid.len() / 2].to_vec()));
    let mut m = valid.clone();
    m[0] ^= 0xff;
    seeds.push(("bad_magic".into(), m));
    let mut m = valid.clone();
    m[4] = 9;
    seeds.push(("bad_version".into(), m));
    let mut m = valid.clone();
    m[200] ^= 0x10;
    seeds.push(("bit_flip".into(), m));
    let mut m = valid.clone();
    let n = m.len();
    m[n - 40 + 4] = 77; // summary frame_count
    reseal(&mut m);
    seeds.push(("summary_mismatch".into(), m));
    let mut m = valid;
    m[152 + 48 + 2] = 40; // heartbeat streams entry_len below v1's 96
    reseal(&mut m);
    seeds.push(("short_entry".into(), m));
    for (name, bytes) in &seeds {
        std::fs::write(dir.join(name), bytes)?;
    }
    println!("wrote {} seeds to {}", seeds.len(), dir.display());
    Ok(())
}
