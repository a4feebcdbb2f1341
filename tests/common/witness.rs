//! Counting, from inside the sandboxes, how many harnesses run at once.

/// A directory every sandbox may write to (its own uid each, as root):
/// `alive/` holds one file per harness while it runs, `seen/` what each
/// harness counted there when it started and before it ended.
pub struct Witness {
    dir: tempfile::TempDir,
}

impl Witness {
    pub fn new() -> Witness {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for sub in ["", "alive", "seen"] {
            let path = dir.path().join(sub);
            std::fs::create_dir_all(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o1777)).unwrap();
        }
        Witness { dir }
    }

    pub fn path(&self) -> String {
        self.dir.path().display().to_string()
    }

    /// The shell lines that mark a harness alive and record what it sees.
    pub fn enter(&self) -> String {
        let d = self.path();
        format!(r#"me="${{CORRAL_RUN_ID:?}}"; touch "{d}/alive/$me"; ls "{d}/alive" | wc -l > "{d}/seen/$me.start";"#)
    }

    pub fn leave(&self) -> String {
        let d = self.path();
        format!(r#"ls "{d}/alive" | wc -l > "{d}/seen/$me.end"; rm -f "{d}/alive/$me";"#)
    }

    /// A bwrap profile whose harness is `script`, with the witness
    /// directory writable.
    pub fn profile(&self, id: &str, script: &str, input: &str) -> String {
        format!(
            r#"id = "{id}"
version = "1.0.0"
[rein]
argv = ["/bin/sh", "-c", '''{script}''']
input = "{input}"
[sandbox]
type = "linux_bwrap"
allow_network = false
write_paths = [".", "{}"]
[limits]
timeout_seconds = 60
max_output_bytes = 65536
"#,
            self.path()
        )
    }

    /// How many harnesses started, and the most any of them saw alive at
    /// once (itself included).
    pub fn counts(&self) -> (usize, usize) {
        let mut started = 0;
        let mut most = 0;
        for entry in std::fs::read_dir(self.dir.path().join("seen")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "start") {
                started += 1;
            }
            let n: usize = std::fs::read_to_string(&path).unwrap().trim().parse().unwrap_or(0);
            most = most.max(n);
        }
        (started, most)
    }
}
