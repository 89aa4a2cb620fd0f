//! Synthetic checkpoints (placeholder while written).
