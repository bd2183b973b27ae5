//! A real headless browser for the console's tests: Debian's `chromium`
//! driven through `chromedriver` (WebDriver) with fantoccini. Screenshots
//! go to `target/screenshots/<test id>/`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use tokio::process::{Child, Command};

use crate::process::{bin_dir, free_port};

/// Where Debian installs the browser and its driver.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A chromedriver process and one browser session on it; both end when dropped.
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
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
        let http = reqwest::Client::new();
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
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                         "--disable-gpu", "--window-size=1400,1100"],
            }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&url)
            .await
            .expect("a chromium session");
        let screenshots = bin_dir()
            .parent()
            .expect("target/")
            .join("screenshots")
            .join(test_id);
        std::fs::create_dir_all(&screenshots).expect("create the screenshots folder");
        Self {
            client,
            driver,
            screenshots,
        }
    }

    /// Saves a screenshot of the page as `<name>.png` and returns its path.
    ///
    /// # Panics
    /// When the browser cannot take it.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = self.screenshots.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        eprintln!("screenshot: {}", path.display());
        path
    }

    /// The text of the first element `css` selects, once one exists. The
    /// live parts of a page are replaced as they change, which can make an
    /// element found a moment ago stale: it is looked up again then.
    ///
    /// # Panics
    /// When none can be read within 10 seconds.
    pub async fn text(&self, css: &str) -> String {
        let client = self.client.clone();
        crate::wait_until(
            &format!("the text of {css}"),
            Duration::from_secs(10),
            || {
                let client = client.clone();
                async move {
                    let element = client
                        .find(Locator::Css(css))
                        .await
                        .map_err(|e| e.to_string())?;
                    element.text().await.map_err(|e| e.to_string())
                }
            },
        )
        .await
    }

    /// Clicks the first element `css` selects, once one exists (looked up
    /// again when it went stale, as [`Browser::text`]).
    ///
    /// # Panics
    /// When none can be clicked within 10 seconds.
    pub async fn click(&self, css: &str) {
        let client = self.client.clone();
        crate::wait_until(
            &format!("a click on {css}"),
            Duration::from_secs(10),
            || {
                let client = client.clone();
                async move {
                    let element = client
                        .find(Locator::Css(css))
                        .await
                        .map_err(|e| e.to_string())?;
                    element.click().await.map_err(|e| e.to_string())
                }
            },
        )
        .await
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
        let client = self.client.clone();
        crate::wait_until(&format!("{css} [{attribute}={value}]"), timeout, || {
            let client = client.clone();
            async move {
                let element = client
                    .find(Locator::Css(css))
                    .await
                    .map_err(|e| e.to_string())?;
                let seen = element.attr(attribute).await.map_err(|e| e.to_string())?;
                if seen.as_deref() == Some(value) {
                    Ok(())
                } else {
                    Err(format!("{seen:?}"))
                }
            }
        })
        .await;
    }

    /// Ends the session and the driver.
    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill().await;
    }
}
