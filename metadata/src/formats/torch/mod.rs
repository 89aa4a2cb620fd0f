//! The `torch.save` layer that PyTorch DCP, DeepSpeed and ByteCheckpoint checkpoints all sit on,
//! read without running any of it: a pickle virtual machine that builds plain values and never
//! executes code ([`pickle`]), the ZIP archives `torch.save` writes read from their directory
//! inward ([`zip`]), and a tensor blob taken apart without reading its data ([`blob`]). Each
//! format's reader turns what these give into its own model.

pub mod blob;
pub mod pickle;
pub mod zip;
