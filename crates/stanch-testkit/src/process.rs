//! Child processes that a test starts and that end with it, however it ends.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// The first of `names` found on `PATH`, or in `/usr/sbin` where Debian puts daemons
/// (nginx, Alertmanager); panics naming what to install.
pub fn program(names: &[&str]) -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    names
        .iter()
        .flat_map(|name| {
            path.split(':')
                .chain(["/usr/sbin"])
                .map(move |dir| PathBuf::from(dir).join(name))
        })
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{} not found: run scripts/install-test-deps.sh", names[0]))
}

/// A running child process, stopped and reaped when dropped: killed, or first asked
/// to stop with SIGTERM when [`Running::terminate_on_drop`] says so (what a process
/// logs on the way out is then written). It is the [`Child`] it holds, for `id`,
/// `try_wait` and the rest.
pub struct Running {
    child: Child,
    program: String,
    terminate_within: Option<Duration>,
}

impl Running {
    /// Spawns `command`; panics naming the program if it cannot be started.
    pub fn spawn(command: &mut Command) -> Running {
        let program = command.get_program().to_string_lossy().into_owned();
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("{program} starts: {e}"));
        Running {
            child,
            program,
            terminate_within: None,
        }
    }

    /// When dropped, sends SIGTERM and waits up to `within` before killing.
    pub fn terminate_on_drop(mut self, within: Duration) -> Running {
        self.terminate_within = Some(within);
        self
    }

    /// Sends `signal` (`-TERM`, `-HUP`, `-9`, … as `kill` takes it); panics if it
    /// could not be sent.
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill {signal} {}", self.program);
    }

    /// How the process exited, if it did within `within`.
    pub fn exited_within(&mut self, within: Duration) -> Option<ExitStatus> {
        crate::wait::blocking::some_within(within, || self.child.try_wait().ok().flatten())
    }
}

impl Deref for Running {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.child
    }
}

impl DerefMut for Running {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(within) = self.terminate_within {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            if self.exited_within(within).is_some() {
                return;
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_is_found_by_its_first_name_on_the_path() {
        let sleep = program(&["no-such-program-here", "sleep"]);
        assert!(
            sleep.ends_with("sleep") && sleep.is_file(),
            "{}",
            sleep.display()
        );
    }

    #[test]
    #[should_panic(expected = "no-such-program-here not found")]
    fn a_missing_program_says_what_to_install() {
        program(&["no-such-program-here"]);
    }

    #[test]
    fn a_dropped_process_is_stopped_and_reaped() {
        let running = Running::spawn(Command::new("sleep").arg("60"));
        let pid = running.id();
        drop(running);
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "no process, not even a zombie, is left behind"
        );
    }

    #[test]
    fn a_signal_reaches_the_process() {
        let mut running = Running::spawn(Command::new("sleep").arg("60"));
        running.signal("-TERM");
        let status = running.exited_within(Duration::from_secs(5));
        assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    }
}
