//! DOT export of generated graphs (GPU): 1000 random DAGs of empty and memset nodes, built
//! from a fixed seed, each exported with `Graph::to_dot_string` and parsed back with a small
//! DOT parser. The text must be one DOT digraph with exactly the graph's nodes and edges: the
//! counts, the in/out-degree of every node with its kind (a memset node's record label starts
//! with `MEMSET`), endpoints that are declared nodes, no cycle.
//!
//! The parser itself has CPU tests here, on text in the driver's style.

use std::collections::{BTreeMap, BTreeSet};

use cuda_graph::{Context, DeviceBuffer, Graph, MemsetValue, Node, NodeKind};

// ---- a small DOT parser -------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    /// A bare identifier or numeral, a quoted string (unescaped) or an HTML string.
    Id(String),
    /// `{ } [ ] = ; , :`
    Punct(char),
    /// `->` (true) or `--` (false).
    Edge(bool),
}

fn lex(text: &str) -> Result<Vec<Tok>, String> {
    let s: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let at_line_start = |i: usize| {
        s[..i]
            .iter()
            .rev()
            .take_while(|&&c| c != '\n')
            .all(|c| c.is_whitespace())
    };
    while i < s.len() {
        let c = s[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '/' && s.get(i + 1) == Some(&'/') || c == '#' && at_line_start(i) {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && s.get(i + 1) == Some(&'*') {
            let end = (i + 2..s.len().saturating_sub(1))
                .find(|&j| s[j] == '*' && s[j + 1] == '/')
                .ok_or(format!("unterminated comment at {i}"))?;
            i = end + 2;
        } else if "{}[]=;,:".contains(c) {
            out.push(Tok::Punct(c));
            i += 1;
        } else if c == '-' && (s.get(i + 1) == Some(&'>') || s.get(i + 1) == Some(&'-')) {
            out.push(Tok::Edge(s[i + 1] == '>'));
            i += 2;
        } else if c == '"' {
            let mut v = String::new();
            i += 1;
            loop {
                match s.get(i) {
                    None => return Err("unterminated string".into()),
                    Some('"') => break,
                    // `\"` is the one escape; other backslashes stay (record labels use `\<`).
                    Some('\\') if s.get(i + 1) == Some(&'"') => {
                        v.push('"');
                        i += 2;
                    }
                    Some('\\') if s.get(i + 1) == Some(&'\n') => i += 2,
                    Some(&ch) => {
                        v.push(ch);
                        i += 1;
                    }
                }
            }
            i += 1;
            out.push(Tok::Id(v));
        } else if c == '<' {
            let mut depth = 0;
            let start = i;
            loop {
                match s.get(i) {
                    None => return Err(format!("unterminated HTML string at {start}")),
                    Some('<') => depth += 1,
                    Some('>') => depth -= 1,
                    _ => {}
                }
                i += 1;
                if depth == 0 {
                    break;
                }
            }
            out.push(Tok::Id(s[start + 1..i - 1].iter().collect()));
        } else if c.is_alphanumeric() || c == '_' || c == '.' || c == '-' || !c.is_ascii() {
            let start = i;
            while i < s.len()
                && (s[i].is_alphanumeric() || s[i] == '_' || s[i] == '.' || !s[i].is_ascii())
                || i == start
            {
                i += 1;
            }
            out.push(Tok::Id(s[start..i].iter().collect()));
        } else {
            return Err(format!("unexpected {c:?} at {i}"));
        }
    }
    Ok(out)
}

/// A parsed DOT graph: nodes in first-mention order with their attributes, and edges.
#[derive(Debug, Default)]
struct Dot {
    directed: bool,
    nodes: Vec<String>,
    attrs: BTreeMap<String, BTreeMap<String, String>>,
    edges: Vec<(String, String)>,
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    dot: Dot,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn peek_at(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.pos + k)
    }
    fn next(&mut self) -> Result<Tok, String> {
        let t = self.toks.get(self.pos).cloned().ok_or("unexpected end")?;
        self.pos += 1;
        Ok(t)
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: char) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!(
                "expected {c:?} at token {}, got {:?}",
                self.pos,
                self.peek()
            ))
        }
    }
    fn id(&mut self) -> Result<String, String> {
        match self.next()? {
            Tok::Id(s) => Ok(s),
            t => Err(format!(
                "expected an ID at token {}, got {t:?}",
                self.pos - 1
            )),
        }
    }
    fn keyword(&self, k: usize, word: &str) -> bool {
        matches!(self.peek_at(k), Some(Tok::Id(s)) if s.eq_ignore_ascii_case(word))
    }

    fn graph(mut self) -> Result<Dot, String> {
        if self.keyword(0, "strict") {
            self.pos += 1;
        }
        self.dot.directed = if self.keyword(0, "digraph") {
            true
        } else if self.keyword(0, "graph") {
            false
        } else {
            return Err(format!("not a DOT graph: starts with {:?}", self.peek()));
        };
        self.pos += 1;
        if matches!(self.peek(), Some(Tok::Id(_))) {
            self.pos += 1;
        }
        self.expect('{')?;
        self.stmt_list()?;
        self.expect('}')?;
        if self.pos != self.toks.len() {
            return Err(format!("text after the graph at token {}", self.pos));
        }
        Ok(self.dot)
    }

    /// Statements up to (not including) the closing `}`; returns the nodes mentioned.
    fn stmt_list(&mut self) -> Result<Vec<String>, String> {
        let mut mentioned = Vec::new();
        while self.peek().is_some() && self.peek() != Some(&Tok::Punct('}')) {
            mentioned.extend(self.stmt()?);
            self.eat(';');
        }
        Ok(mentioned)
    }

    fn attr_list(&mut self) -> Result<Vec<(String, String)>, String> {
        let mut attrs = Vec::new();
        while self.eat('[') {
            while !self.eat(']') {
                let k = self.id()?;
                self.expect('=')?;
                let v = self.id()?;
                attrs.push((k, v));
                if !self.eat(';') {
                    self.eat(',');
                }
            }
        }
        Ok(attrs)
    }

    fn declare(&mut self, name: &str) {
        if !self.dot.attrs.contains_key(name) {
            self.dot.nodes.push(name.to_string());
            self.dot.attrs.insert(name.to_string(), BTreeMap::new());
        }
    }

    /// A node ID (with its port dropped) or a subgraph: the nodes it stands for.
    fn operand(&mut self) -> Result<Vec<String>, String> {
        if self.keyword(0, "subgraph") || self.peek() == Some(&Tok::Punct('{')) {
            if self.keyword(0, "subgraph") {
                self.pos += 1;
                if matches!(self.peek(), Some(Tok::Id(_))) {
                    self.pos += 1;
                }
            }
            self.expect('{')?;
            let nodes = self.stmt_list()?;
            self.expect('}')?;
            return Ok(nodes);
        }
        let name = self.id()?;
        if self.eat(':') {
            self.id()?;
            if self.eat(':') {
                self.id()?;
            }
        }
        self.declare(&name);
        Ok(vec![name])
    }

    fn stmt(&mut self) -> Result<Vec<String>, String> {
        // ID '=' ID: a graph attribute.
        if matches!(self.peek(), Some(Tok::Id(_))) && self.peek_at(1) == Some(&Tok::Punct('=')) {
            self.pos += 1;
            self.pos += 1;
            self.id()?;
            return Ok(Vec::new());
        }
        if ["graph", "node", "edge"].iter().any(|w| self.keyword(0, w)) {
            self.pos += 1;
            self.attr_list()?;
            return Ok(Vec::new());
        }
        let mut from = self.operand()?;
        let mut mentioned = from.clone();
        let mut edges = Vec::new();
        while let Some(&Tok::Edge(directed)) = self.peek() {
            if directed != self.dot.directed {
                return Err(format!(
                    "edge operator of the wrong kind at token {}",
                    self.pos
                ));
            }
            self.pos += 1;
            let to = self.operand()?;
            for f in &from {
                for t in &to {
                    edges.push((f.clone(), t.clone()));
                }
            }
            mentioned.extend(to.iter().cloned());
            from = to;
        }
        let attrs = self.attr_list()?;
        if edges.is_empty() {
            for n in &mentioned {
                self.dot
                    .attrs
                    .entry(n.clone())
                    .or_default()
                    .extend(attrs.iter().cloned());
            }
        }
        self.dot.edges.extend(edges);
        Ok(mentioned)
    }
}

fn parse_dot(text: &str) -> Result<Dot, String> {
    Parser {
        toks: lex(text)?,
        pos: 0,
        dot: Dot::default(),
    }
    .graph()
}

/// (is a memset, in-degree, out-degree) of every node, sorted.
fn degree_profile(
    nodes: &[String],
    is_memset: impl Fn(&str) -> bool,
    edges: &[(String, String)],
) -> Vec<(bool, usize, usize)> {
    let mut v: Vec<(bool, usize, usize)> = nodes
        .iter()
        .map(|n| {
            let ins = edges.iter().filter(|e| &e.1 == n).count();
            let outs = edges.iter().filter(|e| &e.0 == n).count();
            (is_memset(n), ins, outs)
        })
        .collect();
    v.sort();
    v
}

/// Whether the edges over `nodes` form no cycle (Kahn's algorithm).
fn acyclic(nodes: &[String], edges: &[(String, String)]) -> bool {
    let mut indegree: BTreeMap<&str, usize> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
    for (_, t) in edges {
        *indegree.entry(t.as_str()).or_default() += 1;
    }
    let mut ready: Vec<&str> = indegree
        .iter()
        .filter(|(_, d)| **d == 0)
        .map(|(n, _)| *n)
        .collect();
    let mut done = 0;
    while let Some(n) = ready.pop() {
        done += 1;
        for (f, t) in edges {
            if f == n {
                let d = indegree.get_mut(t.as_str()).expect("declared");
                *d -= 1;
                if *d == 0 {
                    ready.push(t);
                }
            }
        }
    }
    done == indegree.len()
}

/// Whether a parsed node is a memset: its record label starts with the node type.
fn dot_is_memset(dot: &Dot, node: &str) -> bool {
    dot.attrs[node]
        .get("label")
        .is_some_and(|l| l.trim_start_matches(['{', ' ', '\n']).starts_with("MEMSET"))
}

// ---- the parser on text in the driver's style (CPU) -----------------------------------------

/// Written after the driver's verbose format: a dashed cluster per graph, one quoted node
/// statement per node with a record label (type first), quoted edges.
const SAMPLE: &str = r#"digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="solid" style="solid" shape="record" label="{MEMSET
| {{ID | node handle | dptr | pitch | value | elementSize | width | height} | {0 (topoId: 2) | 0x00000000DEADBEEF | 0x00007F0000000000 | 0 | 7 | 4 | 64 | 1}}}"];

"graph_1_node_1"[style="solid" shape="record" label="{EMPTY
| {{ID | node handle} | {1 (topoId: 1) | 0x00000000DEADBF00}}}"];

"graph_1_node_2"[style="bold" shape="record" label="{KERNEL
| {ID | 2 (topoId: 0) | add_f32\<\<\<\{17,1,1\},256,0\>\>\>}
| {{node handle | func handle} | {0x00000000DEADBF10 | 0x0000000012345678}}
}"];

"graph_1_node_0" -> "graph_1_node_1" [style="solid"];
"graph_1_node_0" -> "graph_1_node_2";
"graph_1_node_1" -> "graph_1_node_2";
}
}
"#;

#[test]
fn parser_reads_the_driver_style() {
    let dot = parse_dot(SAMPLE).expect("parses");
    assert!(dot.directed);
    assert_eq!(
        dot.nodes,
        ["graph_1_node_0", "graph_1_node_1", "graph_1_node_2"]
    );
    assert_eq!(dot.edges.len(), 3);
    assert!(dot_is_memset(&dot, "graph_1_node_0"));
    assert!(!dot_is_memset(&dot, "graph_1_node_1"));
    assert!(dot.attrs["graph_1_node_2"]["label"].contains(r"add_f32\<\<\<"));
    assert!(acyclic(&dot.nodes, &dot.edges));
    assert_eq!(
        degree_profile(&dot.nodes, |n| dot_is_memset(&dot, n), &dot.edges),
        [(false, 1, 1), (false, 2, 0), (true, 0, 2)]
    );
}

#[test]
fn parser_reads_the_rest_of_the_grammar_and_rejects_bad_text() {
    let text = "/* c */ strict digraph G { // line\n# pre\n a -> b -> {c d} [w=1, x=<<b>y</b>>]; \
                subgraph s { e:p:n; } node [shape=box] rankdir=LR; f }";
    let dot = parse_dot(text).expect("parses");
    assert_eq!(dot.nodes, ["a", "b", "c", "d", "e", "f"]);
    let edges: Vec<(&str, &str)> = dot
        .edges
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    assert_eq!(edges, [("a", "b"), ("b", "c"), ("b", "d")]);
    assert!(!acyclic(
        &dot.nodes,
        &[("a".into(), "b".into()), ("b".into(), "a".into())]
    ));
    for bad in [
        "",
        "digraph {",
        "digraph { a -- b }",
        "graph { a -> b }",
        "digraph { \"a }",
        "digraph { a } b",
        "flowchart { a }",
        "digraph { a [x] }",
    ] {
        assert!(parse_dot(bad).is_err(), "{bad:?} parsed");
    }
}

// ---- the GPU test -------------------------------------------------------------------------

/// splitmix64: a fixed, dependency-free sequence.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn dot_of_random_dags_parses_with_their_nodes_and_edges() {
    let ctx = Context::default_device().expect("context");
    let buf = DeviceBuffer::<u32>::alloc(&ctx, 64).expect("alloc");
    let mut rng = Rng(0x00d0_7f22);
    for case in 0..1000 {
        let n = 1 + rng.below(24) as usize;
        // Percent chance of each forward edge i -> j (i < j): sparse to dense.
        let density = rng.below(60);
        let mut g = Graph::new(&ctx).expect("graph");
        let mut nodes: Vec<Node> = Vec::new();
        let mut memset = Vec::new();
        let mut edges = BTreeSet::new();
        let mut later = Vec::new();
        for j in 0..n {
            let mut deps = Vec::new();
            for (i, &from) in nodes.iter().enumerate() {
                if rng.below(100) < density {
                    edges.insert((i, j));
                    // Half given at creation, half added as edges afterwards.
                    if rng.below(2) == 0 {
                        deps.push(from);
                    } else {
                        later.push((i, j));
                    }
                }
            }
            let is_memset = rng.below(2) == 0;
            let node = if is_memset {
                let value = MemsetValue::U32(rng.next_u64() as u32);
                g.add_memset(&deps, &buf, value).expect("memset").node()
            } else {
                g.add_empty(&deps).expect("empty").node()
            };
            nodes.push(node);
            memset.push(is_memset);
        }
        for (i, j) in later {
            g.add_dependency(nodes[i], nodes[j]).expect("edge");
        }
        let what = format!("case {case}: {n} nodes, edges {edges:?}");
        // The driver's own view first.
        let listed = g.nodes().expect("nodes");
        assert_eq!(listed.len(), n, "{what}");
        let memsets = memset.iter().filter(|&&m| m).count();
        assert_eq!(
            listed.iter().filter(|x| x.kind == NodeKind::Memset).count(),
            memsets,
            "{what}"
        );
        assert_eq!(g.edges().expect("edges").len(), edges.len(), "{what}");

        let text = g.to_dot_string().expect("dot");
        let dot = parse_dot(&text).unwrap_or_else(|e| panic!("{what}: {e}\n{text}"));
        assert!(dot.directed, "{what}: not a digraph\n{text}");
        assert_eq!(dot.nodes.len(), n, "{what}: nodes\n{text}");
        assert_eq!(dot.edges.len(), edges.len(), "{what}: edges\n{text}");
        let unique: BTreeSet<_> = dot.edges.iter().collect();
        assert_eq!(
            unique.len(),
            dot.edges.len(),
            "{what}: duplicate edges\n{text}"
        );
        assert!(acyclic(&dot.nodes, &dot.edges), "{what}: cycle\n{text}");
        let dot_memsets = dot.nodes.iter().filter(|x| dot_is_memset(&dot, x)).count();
        assert_eq!(dot_memsets, memsets, "{what}: memset labels\n{text}");

        let names: Vec<String> = (0..n).map(|i| i.to_string()).collect();
        let built: Vec<(String, String)> = edges
            .iter()
            .map(|&(i, j)| (names[i].clone(), names[j].clone()))
            .collect();
        let want = degree_profile(&names, |x| memset[x.parse::<usize>().unwrap()], &built);
        let got = degree_profile(&dot.nodes, |x| dot_is_memset(&dot, x), &dot.edges);
        assert_eq!(got, want, "{what}: degrees\n{text}");
    }
}
