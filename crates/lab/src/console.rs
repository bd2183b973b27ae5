//! Running the console against a test's deployment, and talking to it as
//! its users do: an operator and a viewer, with basic auth or a bearer
//! token, and the CSRF token of their actions.

use reqwest::{Method, RequestBuilder, Response};

use crate::process::{free_port, Service};
use crate::settings::Setting;
use crate::TestEnv;

/// The operator of the test console: (name, secret).
pub const OPERATOR: (&str, &str) = ("ann", "ann-operator-secret-0123456789");
/// The viewer of the test console: (name, secret).
pub const VIEWER: (&str, &str) = ("bob", "bob-viewer-secret-0123456789");

/// The `console.users` of the test console.
pub fn users() -> String {
    format!(
        "{}:operator:{},{}:viewer:{}",
        OPERATOR.0, OPERATOR.1, VIEWER.0, VIEWER.1
    )
}

/// How a request authenticates.
#[derive(Debug, Clone, Copy)]
pub enum As {
    /// No credentials.
    Nobody,
    /// Basic auth as the operator.
    Operator,
    /// Basic auth as the viewer.
    Viewer,
    /// The operator's secret as a bearer token.
    OperatorToken,
    /// The viewer's secret as a bearer token.
    ViewerToken,
    /// Basic auth with a wrong secret.
    Wrong,
}

/// A client of a running console.
#[derive(Clone)]
pub struct ConsoleClient {
    http: reqwest::Client,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// The port.
    pub port: u16,
}

impl ConsoleClient {
    /// A request to `path` authenticated as `who`.
    pub fn request(&self, method: Method, path: &str, who: As) -> RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match who {
            As::Nobody => request,
            As::Operator => request.basic_auth(OPERATOR.0, Some(OPERATOR.1)),
            As::Viewer => request.basic_auth(VIEWER.0, Some(VIEWER.1)),
            As::OperatorToken => request.bearer_auth(OPERATOR.1),
            As::ViewerToken => request.bearer_auth(VIEWER.1),
            As::Wrong => request.basic_auth(OPERATOR.0, Some("not-the-secret-0123456789")),
        }
    }

    /// GET `path` as `who`.
    ///
    /// # Panics
    /// When the console does not answer.
    pub async fn get(&self, path: &str, who: As) -> Response {
        self.request(Method::GET, path, who)
            .send()
            .await
            .expect("the console answers")
    }

    /// The CSRF token of `who` (from `GET /api/session`).
    ///
    /// # Panics
    /// When the session cannot be read.
    pub async fn csrf(&self, who: As) -> String {
        let session: serde_json::Value = self
            .get("/api/session", who)
            .await
            .json()
            .await
            .expect("a session");
        session["csrf_token"]
            .as_str()
            .expect("a csrf_token")
            .to_owned()
    }

    /// POSTs `body` (JSON) to `path` as `who` with `who`'s CSRF token.
    ///
    /// # Panics
    /// When the console does not answer.
    pub async fn act(&self, path: &str, who: As, body: serde_json::Value) -> Response {
        let token = self.csrf(who).await;
        self.request(Method::POST, path, who)
            .header("x-csrf-token", token)
            .json(&body)
            .send()
            .await
            .expect("the console answers")
    }
}

impl TestEnv {
    /// Starts the console for this deployment with the test's users
    /// ([`OPERATOR`], [`VIEWER`]) plus `settings`, and waits until it answers.
    ///
    /// # Panics
    /// When it does not answer within 20 seconds.
    pub async fn console(&self, settings: &[Setting]) -> (Service, ConsoleClient) {
        let port = free_port();
        let mut all = vec![
            Setting::Listen(port),
            Setting::ConsoleUsers(users()),
            Setting::ConsoleLiveIntervalMs(300),
        ];
        all.extend_from_slice(settings);
        let service = self.spawn("console", "console", &all);
        crate::install_crypto_provider();
        let client = ConsoleClient {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("an HTTP client"),
            base: format!("http://127.0.0.1:{port}"),
            port,
        };
        crate::wait::wait_ready("the console", &client.base).await;
        (service, client)
    }
}
