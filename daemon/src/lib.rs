//! tetherd.
