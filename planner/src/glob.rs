//! Glob matching for layout rules: `*` matches any run of characters (dots included), `?` one.

/// True when `text` matches `pattern`.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p = pattern.as_bytes();
    let t = text.as_bytes();
    let (mut pi, mut ti) = (0, 0);
    // Position of the last `*` and the text index it was tried at: classic linear backtracking.
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs() {
        assert!(glob_match("*", "model.layers.3.attn.qkv.weight"));
        assert!(glob_match(
            "model.layers.*.attn.qkv.weight",
            "model.layers.3.attn.qkv.weight"
        ));
        assert!(glob_match("*embed*", "model.embed_tokens.weight"));
        assert!(!glob_match(
            "*attn.qkv.weight",
            "optim.state.model.layers.0.attn.qkv.weight.exp_avg"
        ));
        assert!(glob_match(
            "*qkv.weight*",
            "optim.state.model.layers.0.attn.qkv.weight.exp_avg"
        ));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("", ""));
        assert!(!glob_match("", "a"));
    }
}
