//! Small helpers of envd's surface: paths as envd resolves them, query strings, times.

/// The sandbox user's home, the workspace: where `user`'s relative paths and `~` point.
pub const HOME: &str = "/home/user";

/// `root`'s home.
pub const ROOT_HOME: &str = "/root";

/// The home of an envd user (`user` or `root`, the users
/// [`check_user`](crate::auth::check_user) admits).
pub fn home_of(user: &str) -> &'static str {
    if user == "root" { ROOT_HOME } else { HOME }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// RFC 3339 (UTC, second precision with milliseconds) of ms since the epoch.
pub fn rfc3339(ms: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_owned())
}

/// Parse RFC 3339 into ms since the epoch.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// Resolve an envd path the way envd does (`ExpandAndResolve`): `~` is the home of the
/// user the operation runs as, and a relative path is relative to it (`root`'s is
/// `/root`). The provider's seam confines the result to the sandbox.
pub fn resolve_path(path: &str, user: &str) -> String {
    let home = home_of(user);
    let p = path.trim();
    if p == "~" {
        return home.to_owned();
    }
    if let Some(rest) = p.strip_prefix("~/") {
        return format!("{home}/{rest}");
    }
    if p.starts_with('/') {
        p.to_owned()
    } else if p.is_empty() {
        home.to_owned()
    } else {
        format!("{home}/{p}")
    }
}

/// Percent-decode (`+` left alone).
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex_val(b[i + 1]), hex_val(b[i + 2]))
        {
            out.push(h * 16 + l);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// `application/x-www-form-urlencoded` pairs of a query string.
pub fn form_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect()
}

/// The value of a query parameter.
pub fn query_param(q: Option<&str>, name: &str) -> Option<String> {
    form_pairs(q.unwrap_or(""))
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_decode_as_forms() {
        assert_eq!(
            form_pairs("a=1%2B2&b=x+y&c"),
            vec![
                ("a".into(), "1+2".into()),
                ("b".into(), "x y".into()),
                ("c".into(), String::new())
            ]
        );
        assert_eq!(
            query_param(Some("path=%2Fa%20b&x=1"), "path").as_deref(),
            Some("/a b")
        );
        assert_eq!(query_param(Some("x=1"), "path"), None);
    }

    #[test]
    fn paths_resolve_under_the_home_of_the_user_asked_for() {
        assert_eq!(resolve_path("hello.txt", "user"), "/home/user/hello.txt");
        assert_eq!(resolve_path("hello.txt", "root"), "/root/hello.txt");
        assert_eq!(resolve_path("~/a/b", "root"), "/root/a/b");
        assert_eq!(resolve_path("~", "root"), "/root");
        assert_eq!(resolve_path("", "root"), "/root");
        assert_eq!(resolve_path("", "user"), "/home/user");
        assert_eq!(resolve_path("/etc/hosts", "user"), "/etc/hosts");
    }
}
