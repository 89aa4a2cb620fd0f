//! Human-readable numbers for reports.

/// `1.50 GiB`, `512 B` (binary units, indicatif's formatting).
pub fn bytes(n: u64) -> String {
    indicatif::HumanBytes(n).to_string()
}

/// `[4096, 128]`.
pub fn shape(shape: &[u64]) -> String {
    tessera_metadata::shape_to_string(shape)
}

/// `text` followed by spaces up to `width` characters (none when it is longer). Unlike
/// `format!("{:width$}")` it takes any width: the standard formatter panics above u16::MAX.
pub fn pad_right(text: &str, width: usize) -> String {
    let fill = width.saturating_sub(text.chars().count());
    let mut out = String::with_capacity(text.len() + fill);
    out.push_str(text);
    out.extend(std::iter::repeat_n(' ', fill));
    out
}

/// Spaces up to `width` characters, then `text` (right-aligned).
pub fn pad_left(text: &str, width: usize) -> String {
    let fill = width.saturating_sub(text.chars().count());
    let mut out = String::with_capacity(text.len() + fill);
    out.extend(std::iter::repeat_n(' ', fill));
    out.push_str(text);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_use_binary_units() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(1536), "1.50 KiB");
        assert_eq!(super::bytes(3 * 1024 * 1024 * 1024), "3.00 GiB");
    }

    #[test]
    fn padding_takes_widths_the_formatter_refuses() {
        assert_eq!(super::pad_right("ab", 4), "ab  ");
        assert_eq!(super::pad_left("ab", 4), "  ab");
        assert_eq!(super::pad_right("abc", 2), "abc");
        assert_eq!(super::pad_right("é", 2), "é ");
        assert_eq!(super::pad_right("", 70_000).len(), 70_000);
    }
}
