//! Local provider.
