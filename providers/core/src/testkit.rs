//! The conformance suite every provider runs against itself.
