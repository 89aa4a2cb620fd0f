//! Native format (placeholder while written).
