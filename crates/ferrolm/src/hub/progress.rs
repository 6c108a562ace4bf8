//! A download's progress: a bar with size, speed and time left on a terminal, a few plain
//! lines otherwise (logs, CI).

use std::io::IsTerminal;

use indicatif::{HumanBytes, ProgressBar, ProgressStyle};

/// Reports one file's download on stderr.
pub struct DownloadProgress {
    bar: Option<ProgressBar>,
    name: String,
    size: u64,
    done: u64,
    /// The next quarter to report without a terminal.
    next_quarter: u64,
    started: bool,
}

impl DownloadProgress {
    /// Progress for the file `name`.
    pub fn new(name: &str) -> DownloadProgress {
        DownloadProgress {
            bar: None,
            name: name.to_string(),
            size: 0,
            done: 0,
            next_quarter: 1,
            started: false,
        }
    }
}

impl hf_hub::api::Progress for DownloadProgress {
    // Called again when a cut download resumes: the position is set by `update` after it.
    fn init(&mut self, size: usize, _filename: &str) {
        self.size = size as u64;
        self.done = 0;
        if self.started {
            if let Some(bar) = &self.bar {
                bar.set_position(0);
            }
            return;
        }
        self.started = true;
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(self.size);
            let style = ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message(self.name.clone());
            self.bar = Some(bar);
        } else {
            eprintln!(
                "ferrolm: downloading {} ({})",
                self.name,
                HumanBytes(self.size)
            );
        }
    }

    fn update(&mut self, n: usize) {
        self.done += n as u64;
        match &self.bar {
            Some(bar) => bar.set_position(self.done),
            None => {
                while self.next_quarter < 4 && self.done * 4 >= self.next_quarter * self.size {
                    eprintln!(
                        "ferrolm: {}: {}% ({})",
                        self.name,
                        self.next_quarter * 25,
                        HumanBytes(self.done)
                    );
                    self.next_quarter += 1;
                }
            }
        }
    }

    fn finish(&mut self) {
        match &self.bar {
            Some(bar) => bar.finish(),
            None => eprintln!("ferrolm: downloaded {}", self.name),
        }
    }
}
