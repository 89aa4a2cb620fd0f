//! Human-readable numbers for reports.

/// `1.50 GiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// `[4096, 128]`.
pub fn shape(shape: &[u64]) -> String {
    tessera_metadata::shape_to_string(shape)
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(1536), "1.50 KiB");
        assert_eq!(super::bytes(3 * 1024 * 1024 * 1024), "3.00 GiB");
    }
}
