//! The house: every import points down. Reads `src/` as a newcomer would
//! (`crate::<module>` paths outside comments and test modules) and checks
//! that the top-level modules form no circle, that `types` (the value types
//! the records are made of) depends on nothing else in the crate, that
//! `records` stands on `types` alone, and that no folder's files import each
//! other in a circle (`super::<file>` and `crate::<folder>::<file>` paths).
//! `cargo test --test house -- --nocapture` prints the layers, bottom first.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, but the separate test files.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && !path.to_string_lossy().ends_with("_tests.rs") {
            out.push(path);
        }
    }
    out
}

/// The code of a file without comments and without its `mod tests`.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The module names `prefix` is followed by in `code` (`crate::` → `store`).
fn referenced<'a>(code: &'a str, prefix: &'a str) -> impl Iterator<Item = String> + 'a {
    code.match_indices(prefix).map(move |(at, _)| {
        code[at + prefix.len()..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect()
    })
}

/// The top-level modules and which others each one's code names.
fn top_level() -> Graph {
    let root = src();
    let modules: BTreeSet<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let name = p.file_stem()?.to_str()?.to_string();
            (p.is_dir() || p.extension().is_some_and(|e| e == "rs")).then_some(name)
        })
        .filter(|name| name != "lib" && name != "main")
        .collect();
    let mut graph: Graph = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for file in files(&root) {
        let relative = file.strip_prefix(&root).unwrap();
        let top = relative.components().next().unwrap().as_os_str().to_string_lossy();
        let top = top.trim_end_matches(".rs").to_string();
        if !modules.contains(&top) {
            continue;
        }
        let code = code(&file);
        for named in referenced(&code, "crate::") {
            if modules.contains(&named) && named != top {
                graph.get_mut(&top).unwrap().insert(named);
            }
        }
    }
    graph
}

/// A circle in `graph`, if there is one, as the path around it.
fn circle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next.as_str()) {
                Some(1) => {
                    let from = path.iter().position(|n| n == next).unwrap();
                    let mut found = path[from..].to_vec();
                    found.push(next.clone());
                    return Some(found);
                }
                Some(_) => {}
                None => {
                    if let Some(found) = visit(next, graph, state, path) {
                        return Some(found);
                    }
                }
            }
        }
        path.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if !state.contains_key(node.as_str()) {
            if let Some(found) = visit(node, graph, &mut state, &mut Vec::new()) {
                return Some(found);
            }
        }
    }
    None
}

/// The graph's layers, bottom first: each module sits one above the
/// highest module it names.
fn layers(graph: &Graph) -> Vec<Vec<String>> {
    fn depth(node: &str, graph: &Graph, memo: &mut BTreeMap<String, usize>) -> usize {
        if let Some(d) = memo.get(node) {
            return *d;
        }
        let d = graph.get(node).into_iter().flatten().map(|n| depth(n, graph, memo) + 1).max().unwrap_or(0);
        memo.insert(node.to_string(), d);
        d
    }
    let mut memo = BTreeMap::new();
    let mut out: Vec<Vec<String>> = Vec::new();
    for node in graph.keys() {
        let d = depth(node, graph, &mut memo);
        if out.len() <= d {
            out.resize(d + 1, Vec::new());
        }
        out[d].push(node.clone());
    }
    out
}

#[test]
fn every_import_points_down_and_the_value_types_are_at_the_bottom() {
    let graph = top_level();
    assert!(graph.len() > 10, "found too few modules in src/: {graph:?}");
    if let Some(found) = circle(&graph) {
        panic!("the modules import each other in a circle: {}", found.join(" → "));
    }
    assert_eq!(graph["types"], BTreeSet::new(), "types must depend on nothing else in the crate");
    assert_eq!(graph["records"], BTreeSet::from(["types".to_string()]), "records stand on types alone");
    println!("layers, bottom first:");
    for (at, layer) in layers(&graph).iter().enumerate() {
        println!("  {at:2}  {}", layer.join(", "));
    }
}

#[test]
fn no_folders_files_import_each_other_in_a_circle() {
    let root = src();
    for entry in std::fs::read_dir(&root).unwrap() {
        let folder = entry.unwrap().path();
        if !folder.is_dir() {
            continue;
        }
        let name = folder.file_name().unwrap().to_string_lossy().to_string();
        let own: BTreeSet<String> = std::fs::read_dir(&folder)
            .unwrap()
            .filter_map(|e| {
                let p = e.unwrap().path();
                let stem = p.file_stem()?.to_str()?.to_string();
                (stem != "mod" && !stem.ends_with("_tests")).then_some(stem)
            })
            .collect();
        let mut graph: Graph = own.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
        for file in std::fs::read_dir(&folder).unwrap().map(|e| e.unwrap().path()) {
            let Some(me) = file.file_stem().and_then(|s| s.to_str()).map(String::from) else { continue };
            if !own.contains(&me) || file.is_dir() {
                continue;
            }
            let code = code(&file);
            let inside = format!("crate::{name}::");
            for named in referenced(&code, "super::").chain(referenced(&code, &inside)) {
                if own.contains(&named) && named != me {
                    graph.get_mut(&me).unwrap().insert(named);
                }
            }
        }
        if let Some(found) = circle(&graph) {
            panic!("the files of src/{name}/ import each other in a circle: {}", found.join(" → "));
        }
    }
}

/// The checks themselves find what they look for.
#[test]
fn the_checks_find_a_circle_and_the_layers() {
    let graph: Graph = [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"]), ("d", vec![])]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(circle(&graph), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    let graph: Graph = [("api", vec!["store", "types"]), ("store", vec!["types"]), ("types", vec![])]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(circle(&graph), None);
    assert_eq!(layers(&graph), vec![vec!["types".to_string()], vec!["store".into()], vec!["api".into()]]);
    let code = "use crate::store::Store; // crate::api in a comment\nlet x = crate::types::hex(b);";
    let code = code.lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join("\n");
    assert_eq!(referenced(&code, "crate::").collect::<Vec<_>>(), vec!["store", "types"]);
}
