//! A real headless browser for the console's tests: Debian's `chromium`
//! driven through `chromedriver` with the W3C WebDriver protocol (JSON over
//! HTTP; the few commands the tests need, on reqwest). Screenshots go to
//! `target/screenshots/<test id>/`.
//!
//! Why not fantoccini: it depends on Mozilla's `webdriver` crate, under the
//! MPL-2.0, which `deny.toml` does not allow, and brings second versions of
//! `http` and `cookie`; the protocol subset used here is a page of code.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};
use tokio::process::{Child, Command};

use crate::process::{bin_dir, free_port};

/// Where Debian installs the browser and its driver.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The key of an element reference in WebDriver's JSON.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one browser session on it; both end when dropped.
pub struct Browser {
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>/session/<id>`.
    session: String,
    driver: Child,
    screenshots: PathBuf,
}

impl Browser {
    /// Starts chromedriver and a headless chromium session.
    ///
    /// # Panics
    /// When chromium or chromedriver is missing (scripts/test.sh installs
    /// them) or the session cannot start within 30 seconds.
    pub async fn start(test_id: &str) -> Self {
        for binary in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(binary).exists(),
                "{binary} is missing: install Debian's chromium and chromium-driver (scripts/test.sh does)"
            );
        }
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromedriver");
        let url = format!("http://127.0.0.1:{port}");
        let http = crate::http_client();
        crate::wait_until("chromedriver to answer", Duration::from_secs(30), || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                http.get(format!("{url}/status"))
                    .send()
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        let created: Value = http
            .post(format!("{url}/session"))
            .json(&json!({ "capabilities": { "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": CHROMIUM,
                    "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                             "--disable-gpu", "--window-size=1400,1100"],
                },
            } } }))
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON");
        let id = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no chromium session: {created}"));
        let screenshots = bin_dir()
            .parent()
            .expect("target/")
            .join("screenshots")
            .join(test_id);
        std::fs::create_dir_all(&screenshots).expect("create the screenshots folder");
        Self {
            session: format!("{url}/session/{id}"),
            http,
            driver,
            screenshots,
        }
    }

    /// Sends one command; the `value` of its answer, or the driver's error.
    async fn command(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, String> {
        let mut request = self.http.request(method, format!("{}{path}", self.session));
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| e.to_string())?;
        let status = response.status();
        let answer: Value = response.json().await.map_err(|e| e.to_string())?;
        if status.is_success() {
            Ok(answer["value"].clone())
        } else {
            Err(format!("{status}: {}", answer["value"]))
        }
    }

    /// The reference of the first element `css` selects.
    async fn find(&self, css: &str) -> Result<String, String> {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await?;
        found[ELEMENT]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no element in {found}"))
    }

    /// Opens `url`.
    ///
    /// # Panics
    /// When the browser cannot.
    pub async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await
            .unwrap_or_else(|e| panic!("cannot open {url}: {e}"));
    }

    /// The current page's URL.
    ///
    /// # Panics
    /// When the browser cannot say.
    pub async fn current_url(&self) -> String {
        self.command(reqwest::Method::GET, "/url", None)
            .await
            .expect("the current URL")
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Runs `script` in the page and returns its result.
    ///
    /// # Panics
    /// When the script fails.
    pub async fn execute(&self, script: &str) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
        .unwrap_or_else(|e| panic!("script {script:?} failed: {e}"))
    }

    /// How many elements `css` selects now.
    ///
    /// # Panics
    /// When the browser cannot say.
    pub async fn count(&self, css: &str) -> usize {
        self.command(
            reqwest::Method::POST,
            "/elements",
            Some(json!({ "using": "css selector", "value": css })),
        )
        .await
        .expect("a list of elements")
        .as_array()
        .map_or(0, Vec::len)
    }

    /// The folder this session's screenshots go to (`target/screenshots/<test id>/`).
    pub fn screenshots(&self) -> &Path {
        &self.screenshots
    }

    /// Saves a screenshot of the page as `<name>.png` and returns its path.
    ///
    /// # Panics
    /// When the browser cannot take it.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let encoded = self
            .command(reqwest::Method::GET, "/screenshot", None)
            .await
            .expect("a screenshot");
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().unwrap_or_default())
            .expect("a base64 PNG");
        let path = self.screenshots.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        eprintln!("screenshot: {}", path.display());
        path
    }

    /// Runs `act` on the first element `css` selects until it succeeds: the
    /// live parts of a page are replaced as they change, which can make an
    /// element found a moment ago stale; it is looked up again then.
    async fn on_element<T, F, Fut>(&self, what: &str, css: &str, act: F) -> T
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = Result<T, String>>,
    {
        crate::wait_until(
            &format!("{what} {css}"),
            Duration::from_secs(10),
            || async {
                let element = self.find(css).await?;
                act(element).await
            },
        )
        .await
    }

    /// The text of the first element `css` selects, once one exists.
    ///
    /// # Panics
    /// When none can be read within 10 seconds.
    pub async fn text(&self, css: &str) -> String {
        self.on_element("the text of", css, |element| async move {
            let text = self
                .command(
                    reqwest::Method::GET,
                    &format!("/element/{element}/text"),
                    None,
                )
                .await?;
            Ok(text.as_str().unwrap_or_default().to_owned())
        })
        .await
    }

    /// Clicks the first element `css` selects, once one exists.
    ///
    /// # Panics
    /// When none can be clicked within 10 seconds.
    pub async fn click(&self, css: &str) {
        self.on_element("a click on", css, |element| async move {
            self.command(
                reqwest::Method::POST,
                &format!("/element/{element}/click"),
                Some(json!({})),
            )
            .await
            .map(|_| ())
        })
        .await;
    }

    /// Types `text` into the first element `css` selects.
    ///
    /// # Panics
    /// When none can be typed into within 10 seconds.
    pub async fn type_into(&self, css: &str, text: &str) {
        self.on_element("typing into", css, |element| async move {
            self.command(
                reqwest::Method::POST,
                &format!("/element/{element}/value"),
                Some(json!({ "text": text })),
            )
            .await
            .map(|_| ())
        })
        .await;
    }

    /// Waits until the attribute `attribute` of the element `css` selects
    /// is `value` (for parts of a page that change live), without reloading.
    ///
    /// # Panics
    /// When it is not so within `timeout`.
    pub async fn wait_for_attribute(
        &self,
        css: &str,
        attribute: &str,
        value: &str,
        timeout: Duration,
    ) {
        crate::wait_until(&format!("{css} [{attribute}={value}]"), timeout, || async {
            let element = self.find(css).await?;
            let seen = self
                .command(
                    reqwest::Method::GET,
                    &format!("/element/{element}/attribute/{attribute}"),
                    None,
                )
                .await?;
            if seen.as_str() == Some(value) {
                Ok(())
            } else {
                Err(format!("{seen}"))
            }
        })
        .await;
    }

    /// Ends the session and the driver.
    pub async fn close(mut self) {
        let _ = self.command(reqwest::Method::DELETE, "", None).await;
        let _ = self.driver.kill().await;
    }
}
